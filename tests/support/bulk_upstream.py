"""A small plain-http upstream for bulk and pacing tests, on 127.0.0.1, in a thread of the test process:

- any POST but `/v1/responses`: the body is read and dropped; the answer says how many bytes came;
- `GET /big?n=BYTES`: BYTES zero bytes with a Content-Length, written 1 MiB at a time;
- `POST /v1/responses`: an event stream of `EVENTS` deltas, one every `GAP` seconds (a model stream
  whose pacing a test can see through the proxy).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from urllib.parse import parse_qs, urlsplit

EVENTS = 5
GAP = 0.4
MIB = 1024 * 1024


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        size = int(self.headers.get("content-length") or 0)
        got = 0
        while got < size:
            chunk = self.rfile.read(min(MIB, size - got))
            if not chunk:
                break
            got += len(chunk)
        if self.path.startswith("/v1/responses"):
            return self._drip()
        body = json.dumps({"received": got}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(EVENTS):
            event = (f"event: response.output_text.delta\ndata: "
                     f"{json.dumps({'type': 'response.output_text.delta', 'delta': f'part {i}'})}\n\n").encode()
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()
            time.sleep(GAP)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802
        n = int(parse_qs(urlsplit(self.path).query).get("n", ["0"])[0])
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(n))
        self.end_headers()
        block = bytes(MIB)
        sent = 0
        while sent < n:
            part = block[:min(MIB, n - sent)]
            self.wfile.write(part)
            sent += len(part)


class BulkUpstream:
    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
