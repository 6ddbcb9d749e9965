"""The chaos suite's adversarial scenarios (issue 14): slow, huge and hostile input against the real
proxy. Mixed into chaos.Scenario; each `run_<kind>` records what it observed (with the memory it
cost: peak RSS over the scenario's baseline) and any problem. Every wait is bounded."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import MITMDUMP, ROOT, WsClient, WsRejected, proxy_status, start_raw_post


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """The process's peak RSS while the block runs, sampled every 20 ms."""

    def __init__(self, pid: int):
        self.pid, self.base, self.peak = pid, _rss_mb(pid), 0.0
        self._done = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_mb(self.pid))
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5)

    @property
    def grown(self) -> float:
        return max(0.0, self.peak - self.base)


class AdversarialRuns:
    def _bound(self, peak: PeakRss, what: str) -> None:
        self.observed.append(f"{what}: peak RSS +{peak.grown:.0f} MB")
        limit = self.spec.get("peak_limit_mb")
        if limit is not None and peak.grown > limit:
            self.problems.append(f"peak RSS grew {peak.grown:.0f} MB (limit {limit} MB)")

    def run_slow_reader(self) -> None:
        """A client that reads nothing while the upstream offers --flood-mib MiB."""
        sock = start_raw_post(self.proxy.port, self.url, self.spec["client"])
        try:
            sock.recv(4096)  # committed: the stream began
            with PeakRss(self.proxy.proc.pid) as peak:
                time.sleep(3)
            self._bound(peak, "3 s unread")
        finally:
            sock.close()

    def run_big_body(self) -> None:
        """A request body of `items` reasoning items (43 MB for 300k)."""
        items = [{"type": "reasoning", "id": f"rs_{i}", "summary": [], "encrypted_content": "gAAAA" + "x" * 60}
                 for i in range(int(self.spec.get("items", 300_000)))]
        body = json.dumps({"model": "gpt-fake", "stream": True, "input": items}).encode()
        del items
        with PeakRss(self.proxy.proc.pid) as peak, socket.create_connection(("127.0.0.1", self.proxy.port),
                                                                              timeout=60) as sock:
            sock.sendall(f"POST {self.url} HTTP/1.1\r\nHost: x\r\nauthorization: Bearer {self.spec['client']}\r\n"
                         f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while b"response.completed" not in data and b"response.failed" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        if b"response.completed" not in data:
            self.problems.append("the big request was not answered in full")
        self._bound(peak, f"{len(body) / 1e6:.0f} MB body")

    def run_websocket_huge(self) -> None:
        """One `mib` MiB message on a gated socket: the turn completes."""
        client = WsClient.connect(self.proxy.port, self.url, {"authorization": f"Bearer {self.spec['client']}"},
                                  timeout=30)
        if isinstance(client, WsRejected):
            self.problems.append(f"upgrade answered {client.status}")
            return
        try:
            client.sock.settimeout(120)
            text = "x" * (int(self.spec["mib"]) * 1024 * 1024)
            with PeakRss(self.proxy.proc.pid) as peak:
                started = time.monotonic()
                client.send_json({"type": "response.create", "model": "m", "stream": True, "input": [
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]})
                events = client.recv_turn(120)
                took = time.monotonic() - started
            self.observed.append(f"{self.spec['mib']} MiB message in {took:.1f} s")
            self._bound(peak, "the message")
            if not events or events[-1].get("type") != "response.completed":
                self.problems.append("the turn did not complete")
        finally:
            client.close()

    def run_bridge_probe(self) -> None:
        """Any local process connecting to a SOCKS bridge is refused before the SOCKS server is touched."""
        self.post(self.spec["client"])  # starts the bridge
        before = self.proxies.connections.get("chaos-socks", 0)
        port = next((r["bridge_port"] for r in proxy_status(self.proxy.port)["routes"] if "bridge_port" in r), None)
        if port is None:
            self.problems.append("no bridge running")
            return
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            target = f"127.0.0.1:{self.fake.port}"
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            line = sock.recv(4096).split(b"\r\n", 1)[0].decode()
        self.observed.append(f"bridge answered {line!r}")
        if "407" not in line:
            self.problems.append("the bridge served a stranger")
        if self.proxies.connections.get("chaos-socks", 0) != before:
            self.problems.append("the SOCKS server was touched for a stranger")

    def run_idle_relay(self) -> None:
        """`connections` idle connections to the relay, then closed: no traceback in the log."""
        port = proxy_status(self.proxy.port)["relay_port"]
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(int(self.spec["connections"]))]
        time.sleep(0.5)
        for sock in socks:
            sock.close()
        time.sleep(0.5)
        log = self.proxy.log()
        self.observed.append(f"{len(socks)} idle connections")
        if "Traceback" in log or "Unhandled error" in log:
            self.problems.append("the log has a traceback")

    def run_trickle_bad_token(self) -> None:
        """A bad token announcing a huge body and trickling it: 403 at once, closed within seconds."""
        port = proxy_status(self.proxy.port)["relay_port"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /r/not-a-token HTTP/1.1\r\nHost: x\r\ncontent-length: 1000000000000\r\n\r\nx")
            head = sock.recv(4096)
            answered = time.monotonic() - started
            sock.settimeout(10)
            try:
                while sock.recv(4096):
                    sock.send(b"x")
                    time.sleep(0.5)
            except OSError:
                pass
            closed = time.monotonic() - started
        self.observed.append(f"{head.split(b' ', 2)[1].decode() if b' ' in head else '?'} after "
                             f"{answered * 1000:.0f} ms, closed after {closed:.1f} s")
        if not head.startswith(b"HTTP/1.1 403") or closed > 5:
            self.problems.append("the bad token was not refused and closed quickly")

    def run_deadline(self) -> None:
        """No response head: the answer comes at response_timeout, even below connect_timeout."""
        started = time.monotonic()
        reply = self.post(self.spec["client"])
        took = time.monotonic() - started
        self.observed.append(f"HTTP {reply.status if reply else '-'} after {took:.1f} s")
        if reply is None or reply.status != 502 or took > float(self.spec.get("within_s", 3)):
            self.problems.append("the response deadline was not honoured")

    def run_config_secret(self) -> None:
        """A pool file whose broken line holds a secret: one line at start-up, and no secret in it."""
        secret = "PLANTED-SECRET-7"
        pool = self.tmp / "broken.yaml"
        pool.write_text(f"routes:\n  corp: [http://user:{secret}@127.0.0.1:3128\n")
        done = subprocess.run([MITMDUMP, "--set", f"confdir={self.tmp / 'conf2'}", "-p", "0", "--listen-host",
                               "127.0.0.1", "-s", str(ROOT / "addon" / "failover.py"), "--set",
                               f"failover_config={pool}"], capture_output=True, text=True, timeout=60)
        out = done.stdout + done.stderr
        lines = [x for x in out.splitlines() if x.strip() and "Loading script" not in x]
        self.observed.append(f"exit {done.returncode}, {len(lines)} line(s)")
        if done.returncode == 0 or len(lines) != 1 or secret in out or "Traceback" in out:
            self.problems.append(f"start-up error was not one clean line: {out[-300:]!r}")

    def run_bomb(self) -> None:
        """The client's attempt gets a synchronous 503 whose body decodes to 1 GiB (`encoding`: gzip,
        zstd): the proxy's peak RSS, the slowest answer an unrelated client got from it meanwhile
        (its status page, every 50 ms), and the failover to the spare."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url, data=b'{"stream":true}', method="POST",
                                     headers={"authorization": f"Bearer {self.spec['client']}"})
        try:  # the fake compresses the bomb once, on its first request: not while the proxy is measured
            urllib.request.urlopen(req, timeout=60)
            wire = 0
        except urllib.error.HTTPError as exc:
            wire = len(exc.read())
        slowest, stop = [0.0], threading.Event()

        def unrelated() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    proxy_status(self.proxy.port)
                except OSError:
                    pass
                slowest[0] = max(slowest[0], time.monotonic() - started)
                stop.wait(0.05)

        watcher = threading.Thread(target=unrelated, daemon=True)
        with PeakRss(self.proxy.proc.pid) as peak:
            watcher.start()
            reply = self.post(self.spec["client"])
            time.sleep(0.3)
            stop.set()
            watcher.join(20)
        self.observed.append(f"{wire / 1e6:.2f} MB on the wire, unrelated client's slowest answer "
                             f"{slowest[0] * 1000:.0f} ms")
        self._bound(peak, "the bomb")
        if reply is None or reply.status != 200 or _served(reply.body) != self.spec["spares"][0]:
            self.problems.append("the request did not fail over to the spare")
        if slowest[0] > float(self.spec.get("latency_limit_s", 1.0)):
            self.problems.append(f"an unrelated client waited {slowest[0]:.1f} s")

    def run_debug_log_secrets(self) -> None:
        """A failover with proxy_debug and debug verbosity (proxy_args): no pooled or client key in the log."""
        reply = self.post(self.spec["client"])
        time.sleep(0.3)
        log = self.proxy.log()
        leaked = [key[:12] + "…" for key in [self.spec["client"], *self.spec["spares"]] if key in log]
        self.observed.append(f"HTTP {reply.status if reply else '-'}, {len(log.splitlines())} log lines, "
                             f"{len(leaked)} secret(s) in them")
        if leaked:
            self.problems.append(f"in the debug log: {leaked}")
        if "verdict=failover" not in log:
            self.problems.append("the failover is not in the log")


def _served(body: bytes) -> str | None:
    marker = b"Hello from "
    return body.split(marker, 1)[1].split(b".", 1)[0].decode(errors="replace") if marker in body else None
