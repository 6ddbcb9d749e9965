"""Processes for end-to-end tests, the demo and measurements: the fake upstream and a real `mitmdump -s addon/failover.py`,
both on 127.0.0.1, each stopped by its PID; and a small HTTP client that talks through the proxy.
Every wait is bounded; every mitmdump gets its own temporary confdir. WsClient speaks Responses over a WebSocket."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from codex_failover.net.socks_bridge import pipe_both

ROOT = Path(__file__).resolve().parents[2]  # the repository
PYTHON = sys.executable
MITMDUMP = str(Path(sys.executable).parent / "mitmdump")


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition"):
    """Poll `predicate` every 20 ms until it returns something true (returned), for at most
    `timeout` seconds; then fail, saying what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when there are none (benchmarks' tables)."""
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def med(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def served_by(reply) -> str | None:
    """Whose answer a reply carries: the fake upstream says "Hello from <credential label>."."""
    body = reply.body.decode(errors="replace")
    return body.split("Hello from ", 1)[1].split(".", 1)[0] if "Hello from " in body else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEAD: list[socket.socket] = []  # held for the test process's life: the port stays refused


def dead_port() -> int:
    """A loopback port where a connection is refused for as long as the tests run: bound, never listening.

    A port from `free_port()` is free only when asked; another test's listener (parallel workers) may
    take it before the proxy dials it, and that listener's answer is not "nothing there"."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    _DEAD.append(held)
    return held.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


STARTED: list[subprocess.Popen] = []  # every process the harness started (tests stop leftovers by PID)


def stop_leftovers() -> None:
    """Stop every process the harness started that is still running (a test that failed halfway)."""
    while STARTED:
        stop(STARTED.pop())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


class FakeUpstreamProcess:
    def __init__(self, tmp: Path, *args: str):
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "fake.jsonl"
        self.proc = subprocess.Popen(
            [PYTHON, str(Path(__file__).resolve().parent / "fake_upstream.py"), "--port", "0", "--log", str(self.log_path), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        STARTED.append(self.proc)
        line = self.proc.stdout.readline()  # {"listening": PORT, ...}; bounded by the process itself
        self.port = json.loads(line)["listening"]
        self.base = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.strip()]

    def model_requests(self) -> list[dict]:
        return [r for r in self.requests() if r.get("scenario") not in (None, "other") and "event" not in r]

    def sent_digests(self, expect: str | None = None, credential: str | None = None, timeout: float = 3.0) -> list[str]:
        """sha256 of each streamed response the fake finished sending (of `credential`, if given). It
        logs one just after the response's last write, so a client can have read it all first: with
        `expect`, wait (bounded) until that digest is logged."""
        deadline = time.monotonic() + timeout
        while True:
            sent = [r["sha256"] for r in self.requests() if r.get("event") == "response_sent"
                    and (credential is None or r["credential"] == credential)]
            if expect is None or expect in sent or time.monotonic() > deadline:
                return sent
            time.sleep(0.05)

    def control(self, path: str, order: dict) -> None:
        """POST a test control (`/_fake/...`) to the fake upstream."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("POST", path, body=json.dumps(order))
        conn.getresponse().read()
        conn.close()

    def overload_next(self, credential: str, count: int = 1, scenario: str = "overload") -> None:
        """Make the next `count` model requests of `credential` (its label) follow `scenario`
        (default: overloaded in-stream)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("POST", "/_fake/next", body=json.dumps({"credential": credential, "count": count, "scenario": scenario}))
        conn.getresponse().read()
        conn.close()

    def stop(self) -> None:
        stop(self.proc)


class ProxyProcess:
    def __init__(self, tmp: Path, pool_yaml: str | None, env: dict[str, str] | None = None, extra: list[str] | None = None,
                 addon: bool = True, program: str = "mitmdump", script: Path | None = None):
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.confdir = tmp / "conf"
        args = [str(Path(MITMDUMP).parent / program), "--listen-host", "127.0.0.1", "-p", str(self.port),
                "--set", f"confdir={self.confdir}"]
        if addon:
            args += ["-s", str(script or ROOT / "addon" / "failover.py")]  # another checkout's, for an A/B
        if pool_yaml is not None:
            pool = tmp / "pool.yaml"
            pool.write_text(pool_yaml)
            args += ["--set", f"failover_config={pool}"]
        args += extra or []
        self.log_path = tmp / "mitmdump.log"
        self._log = open(self.log_path, "w")
        # Pool state (SQLite) and HOME in the test's own folder, never the user's ~/.local/state or ~/.codex.
        (tmp / "proxy-home").mkdir(exist_ok=True)
        env = {"XDG_STATE_HOME": str(tmp / "state"), "HOME": str(tmp / "proxy-home"), **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        STARTED.append(self.proc)
        wait_port(self.port, self.proc)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        stop(self.proc)
        self._log.close()


class RedisProcess:
    """A real redis-server (Debian's package) on 127.0.0.1, no persistence, stopped by its PID."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--protected-mode", "yes"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        STARTED.append(self.proc)
        wait_port(self.port, self.proc)

    def stop(self) -> None:
        stop(self.proc)


class MitmwebProcess(ProxyProcess):
    """`mitmweb -s addon/failover.py` on 127.0.0.1 (proxy `port`, web UI `web_port`, password
    `WEB_PASSWORD`), with `api()` to read its JSON API as the browser does."""

    WEB_PASSWORD = "codex-failover-test"

    def __init__(self, tmp: Path, pool_yaml: str | None, env: dict[str, str] | None = None,
                 extra: list[str] | None = None):
        self.web_port = free_port()
        web = [f"--set=web_password={self.WEB_PASSWORD}", "--no-web-open-browser", "--web-host", "127.0.0.1",
               "--web-port", str(self.web_port), *(extra or [])]
        super().__init__(tmp, pool_yaml, env, web, program="mitmweb")
        wait_port(self.web_port, self.proc)
        self._opener = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}/?token={self.WEB_PASSWORD}"

    def api(self, path: str, raw: bool = False):
        """GET `path` of mitmweb's API (after logging in with the password): parsed JSON, or bytes."""
        import http.cookiejar
        import urllib.request

        if self._opener is None:
            self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
            self._opener.open(self.url, timeout=10).read()
        data = self._opener.open(f"http://127.0.0.1:{self.web_port}{path}", timeout=10).read()
        return data if raw else json.loads(data)

    def put(self, path: str, doc: dict) -> None:
        """PUT JSON to mitmweb's API (e.g. `/options`). Tornado's XSRF check compares a header with a
        cookie; mitmweb's UI gets the cookie from its WebSocket, so this sends a pair of its own."""
        import secrets
        import urllib.request

        self.api("/flows", raw=True)  # logged in
        xsrf = secrets.token_hex(16)
        jar = next(h.cookiejar for h in self._opener.handlers if hasattr(h, "cookiejar"))
        cookies = "; ".join(f"{c.name}={c.value}" for c in jar) + f"; _mitmproxy_xsrf={xsrf}"
        req = urllib.request.Request(f"http://127.0.0.1:{self.web_port}{path}", data=json.dumps(doc).encode(),
                                     method="PUT", headers={"content-type": "application/json", "X-XSRFToken": xsrf,
                                                            "Cookie": cookies})
        self._opener.open(req, timeout=10).read()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    first_byte_s: float | None = None  # seconds after the request was sent
    first_byte_at: float | None = None  # wall clock (time.time()), to compare with other processes
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (seconds after sending, bytes)
    started_at: float = 0.0  # wall clock when the request was sent
    truncated: bool = False  # the connection ended before the message did

    def first_seen_at(self, marker: bytes) -> float | None:
        """Wall clock when `marker` had fully arrived (it may straddle chunks)."""
        seen = b""
        for t, chunk in self.chunks:
            seen += chunk
            if marker in seen:
                return self.started_at + t
        return None

    def events(self) -> list[dict]:
        out = []
        for line in self.body.decode().splitlines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
        return out

    def json(self) -> dict:
        return json.loads(self.body)


def post_responses(proxy_port: int, url: str, token: str, body: dict | bytes | None = None, timeout: float = 30.0,
                   headers: dict[str, str] | None = None, ca: Path | None = None) -> Reply:
    """POST a Codex-like streaming request through the proxy and read the whole answer (`body`: a
    dict sent as JSON, or the exact bytes to send)."""
    payload = body if isinstance(body, bytes) else json.dumps(
        body if body is not None else {"model": "gpt-fake", "stream": True, "input": [], "store": False})
    all_headers = {"authorization": f"Bearer {token}", "content-type": "application/json", "accept": "text/event-stream",
                   **(headers or {})}
    conn = _connect(proxy_port, url, timeout, ca)
    started, started_at = time.monotonic(), time.time()
    conn.request("POST", _target(url, ca), body=payload, headers=all_headers)
    resp = conn.getresponse()
    reply = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, b"", started_at=started_at)
    data = bytearray()
    while True:
        try:
            chunk = resp.read1(65536)
        except http.client.IncompleteRead as exc:  # the stream was cut: keep what came
            chunk, reply.truncated = exc.partial, True
        if not chunk:
            break
        now = time.monotonic() - started
        if reply.first_byte_s is None:
            reply.first_byte_s, reply.first_byte_at = now, time.time()
        reply.chunks.append((now, chunk))
        data += chunk
        if reply.truncated:
            break
    reply.body = bytes(data)
    conn.close()
    return reply


@contextlib.contextmanager
def upstream_and_proxy(tmp: Path, pool: Callable[[str], str], *fake_args: str, extra: list[str] | None = None):
    """A fake upstream and a proxy whose pool file is `pool(fake.base)`, both stopped afterwards."""
    tmp.mkdir(parents=True, exist_ok=True)
    fake = FakeUpstreamProcess(tmp, *fake_args)
    try:
        proxy = ProxyProcess(tmp, pool(fake.base), extra=extra)
        try:
            yield fake, proxy
        finally:
            proxy.stop()
    finally:
        fake.stop()


def start_raw_post(proxy_port: int, url: str, token: str, timeout: float = 5.0, source_port: int = 0) -> socket.socket:
    """Send a streaming model request through the proxy on a raw socket, and return the socket
    (for tests that read part of the answer, or leave early)."""
    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=timeout, source_address=("127.0.0.1", source_port))
    body = json.dumps({"stream": True, "input": []}).encode()
    sock.sendall(f"POST {url} HTTP/1.1\r\nHost: {url.split('/')[2]}\r\nauthorization: Bearer {token}\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float = 10.0) -> bytes:
    """What a raw socket receives, up to and including `marker` (an assertion if it ends first)."""
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended before {marker!r}: {data[-300:]!r}"
        data += chunk
    return data


@dataclass
class WsRejected:
    """A WebSocket upgrade answered with another status than 101."""
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


WS_TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


class WsClient:
    """A blocking Responses-over-WebSocket client, as Codex connects (plain ws, offering permessage-deflate):
    through the proxy's CONNECT tunnel, or straight to the server when proxy_port is None. Every wait is bounded;
    server pings are answered."""

    def __init__(self, sock: socket.socket, ws: WSConnection):
        self.sock, self.ws = sock, ws
        self.headers: dict[str, str] = {}  # of the 101
        self._events: deque = deque()
        self._text = ""

    @classmethod
    def connect(cls, proxy_port: int | None, url: str, headers: dict[str, str], timeout: float = 10.0) -> "WsClient | WsRejected":
        hostport, _, path = url.split("://", 1)[1].partition("/")
        host, port = hostport.rsplit(":", 1)
        sock = socket.create_connection(("127.0.0.1", proxy_port) if proxy_port else (host, int(port)), timeout=timeout)
        try:
            if proxy_port:
                proxy_connect(sock, hostport)
            ws = WSConnection(ConnectionType.CLIENT)
            sock.sendall(ws.send(Request(host=hostport, target="/" + path, extensions=[PerMessageDeflate()],
                                         extra_headers=[(k.encode(), v.encode()) for k, v in headers.items()])))
            client = cls(sock, ws)
            deadline = time.monotonic() + timeout
            event = client._next(deadline)
            if isinstance(event, AcceptConnection):
                client.headers = {k.decode().lower(): v.decode() for k, v in event.extra_headers}
                return client
            if not isinstance(event, RejectConnection):
                raise ConnectionError(f"unexpected answer to the upgrade: {event!r}")
            rejected = WsRejected(event.status_code, {k.decode().lower(): v.decode() for k, v in event.headers}, b"")
            more = event.has_body
            while more:
                event = client._next(deadline)
                rejected.body, more = rejected.body + event.data, not event.body_finished
            sock.close()
            return rejected
        except BaseException:
            sock.close()
            raise

    def _next(self, deadline: float):
        """The next wsproto event (pings answered on the way); TimeoutError at the deadline."""
        while not self._events:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no WebSocket event in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data and self.ws.state is ConnectionState.CONNECTING:
                raise ConnectionError("the connection closed during the WebSocket handshake")
            self.ws.receive_data(data or None)
            self._events.extend(self.ws.events())
        event = self._events.popleft()
        if isinstance(event, Ping):
            self.sock.sendall(self.ws.send(event.response()))
        return event

    def send_json(self, obj: dict) -> None:
        self.sock.sendall(self.ws.send(TextMessage(data=json.dumps(obj))))

    def send_ping(self, payload: bytes = b"p") -> None:
        self.sock.sendall(self.ws.send(Ping(payload=payload)))

    def recv(self, timeout: float = 10.0) -> tuple:
        """("text", str) | ("bytes", bytes) | ("pong", bytes) | ("close", code, reason); TimeoutError."""
        deadline = time.monotonic() + timeout
        data = b""
        while True:
            event = self._next(deadline)
            if isinstance(event, TextMessage):
                self._text += event.data
                if event.message_finished:
                    text, self._text = self._text, ""
                    return "text", text
            elif isinstance(event, BytesMessage):
                data += event.data
                if event.message_finished:
                    return "bytes", bytes(data)
            elif isinstance(event, Pong):
                return "pong", bytes(event.payload)
            elif isinstance(event, CloseConnection):
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(OSError):
                        self.sock.sendall(self.ws.send(event.response()))
                return "close", int(event.code), event.reason

    def recv_turn(self, timeout: float = 10.0) -> list[dict]:
        """The text messages (as JSON) up to a terminal one, or a close ({"type": "__close__", "code", "reason"})."""
        deadline = time.monotonic() + timeout
        out: list[dict] = []
        while True:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got[0] == "close":
                out.append({"type": "__close__", "code": got[1], "reason": got[2]})
                return out
            if got[0] == "text":
                out.append(json.loads(got[1]))
                if out[-1].get("type") in WS_TERMINAL:
                    return out

    def close(self, code: int = 1000) -> None:
        """Close (waiting a moment for the server's answer) and drop the socket; never raises."""
        try:
            if self.ws.state is ConnectionState.OPEN:
                self.sock.sendall(self.ws.send(CloseConnection(code=code)))
                deadline = time.monotonic() + 1.0
                while self.ws.state is not ConnectionState.CLOSED:
                    self._next(deadline)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        finally:
            self.sock.close()


def proxy_connect(sock: socket.socket, hostport: str) -> None:
    """CONNECT `hostport` through the proxy at the other end of `sock`; ConnectionError unless 200."""
    sock.sendall(f"CONNECT {hostport} HTTP/1.1\r\nHost: {hostport}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the proxy closed the connection during CONNECT")
        head += chunk
    if head.split(b" ", 2)[1] != b"200":
        raise ConnectionError(f"CONNECT refused: {head.splitlines()[0]!r}")


def proxy_status(proxy_port: int) -> dict:
    """The addon's status report (pool health, in-flight counters) through its status host."""
    return json.loads(request(proxy_port, "GET", "http://codex-failover.status/").body)


def request(proxy_port: int, method: str, url: str, headers: dict[str, str] | None = None, body: bytes | None = None,
            timeout: float = 15.0) -> Reply:
    conn = _connect(proxy_port, url, timeout, None)
    conn.request(method, url, body=body, headers=headers or {})
    resp = conn.getresponse()
    reply = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    conn.close()
    return reply


def _connect(proxy_port: int, url: str, timeout: float, ca: Path | None):
    if ca is None:
        return http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=timeout)
    host, port = url.split("://", 1)[1].split("/", 1)[0].split(":")
    conn = http.client.HTTPSConnection("127.0.0.1", proxy_port, timeout=timeout,
                                       context=ssl.create_default_context(cafile=str(ca)))
    conn.set_tunnel(host, int(port))
    return conn


def _target(url: str, ca: Path | None) -> str:
    return "/" + url.split("://", 1)[1].split("/", 1)[1] if ca is not None else url


def make_test_pki(tmp: Path, names: tuple[str, ...] = ("localhost",)) -> tuple[Path, Path]:
    """A private CA and a server certificate it signed for `names` (and 127.0.0.1): (the CA's
    certificate as PEM, the server's key + certificate + CA as one PEM for `fake_upstream --cert`)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    day = datetime.timedelta(days=1)

    def build(subject, issuer, public_key, signing_key, ca: bool, sans=()):
        # Key identifiers too: Python 3.13's default context verifies strictly (VERIFY_X509_STRICT).
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - day).not_valid_after(now + 7 * day)
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()),
                            critical=False))
        if ca:
            b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        else:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return b.sign(signing_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "codex-failover test CA")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaf = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), ca_name, key.public_key(), ca_key,
                 False, sans)
    pem = serialization.Encoding.PEM
    ca_path, server_path = tmp / "test-ca.pem", tmp / "server.pem"
    ca_path.write_bytes(ca.public_bytes(pem))
    server_path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
                            + leaf.public_bytes(pem) + ca.public_bytes(pem))
    return ca_path, server_path


def pool_yaml(base_url: str, creds: list[tuple[str, str]], routes: dict | None = None, overload: dict | None = None,
              **policy) -> tuple[str, dict[str, str]]:
    """A pool file with API-key credentials (name, key[, route]) pointing at `base_url`, and the env
    it needs. `routes`: {name: [proxy urls] or "direct"}; `overload`: the `overload:` section."""
    lines, env = [], {}
    if overload:
        lines += ["overload:", *(f"  {k}: {v}" for k, v in overload.items())]
    if routes:
        lines.append("routes:")
        for name, value in routes.items():
            lines.append(f"  {name}: {json.dumps(value)}")
    lines.append("credentials:")
    for name, key, *route in creds:
        var = "KEY_" + name.upper().replace("-", "_")
        env[var] = key
        lines += [f"  - name: {name}", f"    api_key_env: {var}", f"    base_url: {base_url}/v1"]
        if route:
            lines.append(f"    route: {route[0]}")
    settings = {"max_attempts": 4, "bootstrap_timeout": "5s", **policy}
    lines.append("policy:")
    lines += [f"  {k}: {json.dumps(v) if isinstance(v, bool) else v}" for k, v in settings.items()]
    return "\n".join(lines) + "\n", env


class LocalProxies:
    """An HTTP CONNECT proxy and a SOCKS5 server on 127.0.0.1, run on a background thread's loop,
    counting connections and recording what they were sent (for route tests)."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.connections: dict[str, int] = {}
        self.proxy_auth: dict[str, list[str | None]] = {}
        self._loop = asyncio.new_event_loop()
        self._servers = {}
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def _run(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def http_proxy(self, name: str, mode: str = "ok") -> int:
        """mode: ok (tunnels), refuse (403 to CONNECT), silent (never answers CONNECT),
        flap (refuses every other connection),
        reset (tunnels, then resets the connection once the request went through: a failure after
        dispatch)."""
        return self._start(name, lambda r, w: self._http(name, mode, r, w))

    def socks5(self, name: str, users: dict[str, str] | None = None) -> int:
        return self._start(name, lambda r, w: self._socks(name, users, r, w))

    def _start(self, name: str, handler) -> int:
        import asyncio

        async def start():
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            self._servers[name] = server
            return server.sockets[0].getsockname()[1]

        self.connections[name] = 0
        self.proxy_auth[name] = []
        return self._run(start())

    async def _http(self, name, mode, reader, writer) -> None:
        import asyncio

        self.connections[name] += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            auth = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("proxy-authorization:")), None)
            self.proxy_auth[name].append(auth)
            if mode == "silent":
                await reader.read()  # until the client gives up
                return
            if mode == "refuse" or (mode == "flap" and self.connections[name] % 2 == 1):
                writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                return
            host, port = lines[0].split(" ")[1].rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            if mode == "reset":
                while True:  # forward the whole request, then reset before any answer comes back
                    try:
                        data = await asyncio.wait_for(reader.read(65536), 0.3)
                    except TimeoutError:
                        break
                    if not data:
                        break
                    up_writer.write(data)
                    await up_writer.drain()
                _reset(writer)
                up_writer.close()
                return
            await pipe_both(reader, writer, up_reader, up_writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _socks(self, name, users, reader, writer) -> None:
        import asyncio
        import struct

        self.connections[name] += 1
        try:
            ver, n = await reader.readexactly(2)
            methods = await reader.readexactly(n)
            if users:
                if 2 not in methods:
                    writer.write(b"\x05\xff")
                    return
                writer.write(b"\x05\x02")
                _, ulen = await reader.readexactly(2)
                user = (await reader.readexactly(ulen)).decode()
                (plen,) = await reader.readexactly(1)
                password = (await reader.readexactly(plen)).decode()
                ok = users.get(user) == password
                writer.write(b"\x01\x00" if ok else b"\x01\x01")
                if not ok:
                    return
            else:
                writer.write(b"\x05\x00")
            _, cmd, _, atyp = await reader.readexactly(4)
            if atyp == 3:
                (alen,) = await reader.readexactly(1)
                host = (await reader.readexactly(alen)).decode()
            else:
                host = ".".join(map(str, await reader.readexactly(4)))
            (port,) = struct.unpack("!H", await reader.readexactly(2))
            up_reader, up_writer = await asyncio.open_connection(host, port)
            writer.write(b"\x05\x00\x00\x01" + bytes(4) + b"\x00\x00")
            await writer.drain()
            await pipe_both(reader, writer, up_reader, up_writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()

    def stop(self, name: str) -> None:
        """Stop listening (the endpoint is now dead: connections are refused)."""
        server = self._servers.pop(name)
        self._loop.call_soon_threadsafe(server.close)

    def close(self) -> None:
        for name in list(self._servers):
            self.stop(name)
        self._loop.call_soon_threadsafe(self._loop.stop)


class Blackhole:
    """A loopback port whose connects hang (a full accept queue): like a proxy that drops SYNs."""

    def __init__(self) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(0)
        self.port = self._server.getsockname()[1]
        self._filler = socket.create_connection(("127.0.0.1", self.port), timeout=2)  # fills the queue

    def close(self) -> None:
        self._filler.close()
        self._server.close()


def _reset(writer) -> None:
    import socket as _socket
    import struct

    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
