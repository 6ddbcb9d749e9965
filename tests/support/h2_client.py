"""A small synchronous HTTP/2 client through the proxy (CONNECT, TLS with ALPN h2), for tests that
need what Codex does over HTTP/2: several streams on one connection, and resetting one."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
from harness import proxy_connect


@dataclass
class H2Stream:
    sid: int
    status: int | None = None
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None


def tunnel(proxy_port: int, authority: str, ca, timeout: float = 10.0) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=timeout)
    proxy_connect(raw, authority)
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context.wrap_socket(raw, server_hostname=authority.split(":")[0])


class H2Client:
    """One HTTP/2 connection; a reader thread takes every frame (and acknowledges data)."""

    def __init__(self, proxy_port: int, authority: str, ca, ack: bool = True):
        self.authority, self.ack = authority, ack  # ack=False: never opens a stream's window again
        self.sock = tunnel(proxy_port, authority, ca)
        assert self.sock.selected_alpn_protocol() == "h2", self.sock.selected_alpn_protocol()
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.lock = threading.RLock()
        self.streams: dict[int, H2Stream] = {}
        self.closed = False
        self._flush()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _flush(self) -> None:
        with self.lock:
            data = self.conn.data_to_send()
            if data:
                self.sock.sendall(data)

    def _read(self) -> None:
        self.sock.settimeout(0.2)
        try:
            while not self.closed:
                try:
                    data = self.sock.recv(65536)
                except (TimeoutError, ssl.SSLWantReadError):
                    continue
                if not data:
                    break
                with self.lock:
                    for event in self.conn.receive_data(data):
                        self._on(event)
                    self._flush()
        except OSError:
            pass
        finally:
            self.closed = True

    def _on(self, event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", None) or 0)
        if isinstance(event, h2.events.DataReceived) and self.ack:
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            stream.status = int(dict(event.headers)[":status"])
        elif isinstance(event, h2.events.DataReceived):
            stream.data += event.data
        elif isinstance(event, h2.events.StreamEnded):
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset):
            stream.reset = event.error_code

    def post_model(self, token: str) -> H2Stream:
        """A streaming Codex model request on a new stream."""
        body = json.dumps({"model": "gpt-fake", "stream": True, "input": [], "store": False}).encode()
        headers = [(":method", "POST"), (":scheme", "https"), (":authority", self.authority),
                   (":path", "/v1/responses"), ("authorization", f"Bearer {token}"),
                   ("content-type", "application/json"), ("accept", "text/event-stream"),
                   ("content-length", str(len(body)))]
        with self.lock:
            sid = self.conn.get_next_available_stream_id()
            stream = self.streams[sid] = H2Stream(sid)
            self.conn.send_headers(sid, headers)
            self.conn.send_data(sid, body, end_stream=True)
            self._flush()
        return stream

    def reset(self, stream: H2Stream, code: int = 8) -> None:
        with self.lock:
            self.conn.reset_stream(stream.sid, code)
            self._flush()

    def wait(self, stream: H2Stream, timeout: float = 20.0) -> H2Stream:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if stream.ended or stream.reset is not None or self.closed:
                return stream
            time.sleep(0.01)
        raise AssertionError(f"stream {stream.sid} did not end: status={stream.status} {bytes(stream.data[-200:])!r}")

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
