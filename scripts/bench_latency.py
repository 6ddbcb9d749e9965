#!/usr/bin/env python3
"""Latency benchmark: plain mitmdump against the codex-failover addon with the upstream behind TLS and a
real round-trip time away, side by side and interleaved in one run (`scripts/bench --latency`).

On loopback a TCP or TLS handshake costs nothing, so a proxy that opens a new upstream connection per
request looks as fast as one that keeps them. Here the upstream is RTT ms away, so every round trip the
proxy adds shows up as it would on a real network.

Topology (tests/support/delay_link.py; all local, nothing reaches the internet):

    namespace a                                       namespace b
    client --CONNECT+TLS--> proxy under test  ==[RTT]==>  TLS front (mitmdump reverse, h2 + http/1.1,
    (this process)          (mitmdump, 127.0.0.1)          private CA) --> fake upstream (HTTP/1.1)

- The link: a TUN device in each namespace and one Python process that delays every packet RTT/2 each
  way, so handshakes, slow start and windows pay the RTT. A TCP connect a->b is timed at each RTT.
- The upstream is `https://upstream.bench.test:PORT` (10.77.0.2 through /etc/netns/<a>/hosts), its
  certificate from a private test CA that the proxies trust (ssl_verify_upstream_trusted_ca, never
  ssl_insecure). The front listens on one port per cell, so TCP SYNs counted on the link (and
  connections the front saw) are attributed to exactly one proxy.
- Configurations, each its own mitmdump per client variant (temporary confdirs):
    plain    mitmdump streaming bodies (--set stream_large_bodies=1), no addon
    healthy  mitmdump -s addon/failover.py with a pool (one spare), the request's own credential good
    failover the addon, the own credential overloaded in-stream after response.created, the spare good
    baseline (with --baseline OLD/addon/failover.py) another checkout's addon, healthy: an A/B of two
             commits in one run, interleaved with the others
- Clients, Codex-like (CONNECT, then TLS trusting that proxy's CA): h2 (one HTTP/2 connection for all
  requests, the `h2` library) and h1 (HTTP/1.1 keep-alive, sequential requests on one connection,
  reconnecting only when the proxy closes it). Each request: POST /v1/responses, a ~16 KiB JSON input, a
  unique `Authorization: Bearer` key and session id (health and affinity are per credential/session),
  `accept: text/event-stream`.
- Cells: each RTT x client x configuration. Per RTT: a few warm-up requests per cell, then rounds in
  which every cell sends one request, one request in flight at a time, the order rotating per round so
  drift and order hit all cells alike.

Reported per cell (ms, median / p95, and the median's difference to plain mitmdump in the same RTT and
client): (a) request sent -> first response byte (with the addon: the commit of the held stream),
(b) -> first output event (first reasoning or text delta), (c) -> first text delta; request sent -> the
(first) attempt arrived at the fake upstream; (d) the first output event's own hop: the fake wrote it ->
it arrived at the client (through the TLS front and the proxy; with the addon, this is the commit); per
measured request: upstream TCP connections opened (SYNs on the link to that cell's front port) and used (connections whose first request at the front was
a measured one), attempts at the front, new client connections; the HTTP version the front saw; for
failover, request sent -> the spare's request at the fake. Timestamps across processes are time.time()
on one machine. The host's CPU use while measuring is printed too (other work skews latencies).

    scripts/bench --latency [--quick] [--rtt 0,30] [--requests N] [--json FILE] [--png FILE]
                            [--addon OTHER/addon/failover.py] [--baseline OLD/addon/failover.py]
                            [--from-json FILE]

Full run about 3 minutes, --quick under a minute. Needs root, /dev/net/tun and iproute2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake, link

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from delay_link import DelayLink, available
from harness import MITMDUMP, PYTHON, ROOT, make_test_pki, med, pct, pool_yaml

HOST = "upstream.bench.test"
CONFIGS = {"plain": "plain mitmdump, streaming", "healthy": "addon, healthy",
           "failover": "addon, own cred overloaded"}
FAILING = ("failover", "base-failover")  # the cells whose own key is overloaded
CLIENTS = ("h2", "h1")
SPARE_KEY = "sk-test-spare-good"
LINK_TRIES = 5  # times the link's round trip is measured before the run gives up on it (a busy host)
FAKE_PORT = 9000  # in namespace b (fresh namespaces: every port is free)
FRONT_PORT0 = 4431  # + cell index, in b
PROXY_PORT0 = 8081  # + cell index, in a
REQUEST_TIMEOUT = 30.0  # seconds one request may take at most
START_TIMEOUT = 30.0  # seconds a process may take to listen
TEXT_DELTA = "response.output_text.delta"

# Front-side log: every request the TLS front receives, with the listening port (which proxy sent it)
# and its client connection (one per upstream connection the proxy opened).
FRONT_ADDON = '''
import json, os, time
_out = open(os.environ["CFBENCH_FRONT_LOG"], "a", buffering=1)
def requestheaders(flow):
    _out.write(json.dumps({"ts": time.time(), "port": flow.client_conn.sockname[1], "conn": flow.client_conn.id,
                           "http": flow.request.http_version,
                           "session": flow.request.headers.get("session-id")}) + "\\n")
'''


def is_output(kind: str) -> bool:
    """The first reasoning or text delta: what Codex shows (a held stream commits on it)."""
    return kind == TEXT_DELTA or (kind.startswith("response.reasoning") and kind.endswith(".delta"))


# -- one request's timings --------------------------------------------------------------------

@dataclass
class Sample:
    rtt: float
    client: str
    config: str
    session: str
    sent_at: float = 0.0  # wall clock, to compare with the fake's log
    first_byte_ms: float | None = None
    first_output_ms: float | None = None
    first_text_ms: float | None = None
    total_ms: float | None = None
    to_upstream_ms: float | None = None  # filled from the fake's log
    output_hop_ms: float | None = None  # the fake wrote the first output event -> it arrived (fake's log)
    response_id: str | None = None  # the answer the client got (a failover's winner), and its first output
    first_output_seq: int | None = None  # event's sequence number: to find when the fake wrote it
    first_output_wall: float | None = None
    to_spare_ms: float | None = None  # failover: the spare's request arrived at the fake
    # failover: the fake wrote the rejection -> the spare's request reached the front, less one RTT: the
    # proxy's own time from the rejection to the spare's request (the front's relay of the rejection in it)
    reject_to_spare_ms: float | None = None
    new_connection: bool = False  # the client had to (re)connect to the proxy for this request
    setup_ms: float | None = None  # CONNECT + TLS to the proxy, when new_connection
    status: int = 0
    completed: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.completed and self.first_text_ms is not None


class SseWatch:
    """Feeds the response body as it arrives; notes when the first output / text delta had fully arrived."""

    def __init__(self, sample: Sample, t0: float):
        self.sample, self.t0, self.buf = sample, t0, b""

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        while (end := self.buf.find(b"\n\n")) >= 0:
            event, self.buf = self.buf[:end], self.buf[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:], now)

    def _event(self, data: bytes, now: float) -> None:
        try:
            event = json.loads(data)
            kind = event.get("type", "")
        except (ValueError, AttributeError):
            return
        ms = (now - self.t0) * 1000
        s = self.sample
        if kind == "response.created":
            s.response_id = (event.get("response") or {}).get("id")
        if s.first_output_ms is None and is_output(kind):
            s.first_output_ms = ms
            s.first_output_seq, s.first_output_wall = event.get("sequence_number"), s.sent_at + ms / 1000
        if s.first_text_ms is None and kind == TEXT_DELTA:
            s.first_text_ms = ms
        if kind == "response.completed":
            s.completed = True


def request_body(session: str, input_text: str) -> bytes:
    """As scripts/bench.py builds it: a Codex-like Responses request with a ~16 KiB input."""
    return json.dumps({
        "model": "gpt-fake", "stream": True, "store": False, "instructions": "You are a coding agent.",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": input_text}]}],
        "tools": [], "reasoning": {"effort": "medium", "summary": "auto"}, "prompt_cache_key": session,
    }).encode()


def request_headers(token: str, session: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}"), ("content-type", "application/json"),
            ("accept", "text/event-stream"), ("session-id", session)]


# -- the clients: CONNECT through the proxy, then TLS --------------------------------------------

async def tunnel(proxy_port: int, authority: str, ca: Path, alpn: list[str]):
    """A TLS connection to `authority` through the proxy's CONNECT, verified against the proxy's CA."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port, limit=1 << 20)
    try:
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200" not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"CONNECT refused: {head[:80]!r}")
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.set_alpn_protocols(alpn)
        await writer.start_tls(ctx, server_hostname=authority.rsplit(":", 1)[0])
    except BaseException:
        writer.close()
        raise
    return reader, writer


class H1Client:
    """HTTP/1.1 keep-alive: requests one after another on one connection, a new one only when closed."""

    def __init__(self, proxy_port: int, authority: str, ca: Path):
        self.proxy_port, self.authority, self.ca = proxy_port, authority, ca
        self.reader = self.writer = None
        self.connections = 0

    async def _ensure(self, sample: Sample) -> None:
        if self.writer is not None and not self.writer.is_closing() and not self.reader.at_eof():
            return
        t0 = time.perf_counter()
        self.reader, self.writer = await tunnel(self.proxy_port, self.authority, self.ca, ["http/1.1"])
        self.connections += 1
        sample.new_connection, sample.setup_ms = True, (time.perf_counter() - t0) * 1000

    async def post(self, sample: Sample, token: str, body: bytes) -> None:
        await self._ensure(sample)
        head = ["POST /v1/responses HTTP/1.1", f"host: {self.authority}",
                *(f"{k}: {v}" for k, v in request_headers(token, sample.session)), f"content-length: {len(body)}"]
        t0 = time.perf_counter()
        sample.sent_at = time.time()
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            await self._response(sample, t0)
        except BaseException:
            self._drop()
            raise

    async def _response(self, sample: Sample, t0: float) -> None:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        sample.first_byte_ms = (time.perf_counter() - t0) * 1000
        lines = raw.decode("latin-1").split("\r\n")
        sample.status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        watch = SseWatch(sample, t0)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                watch.feed(await self.reader.readexactly(size), time.perf_counter())
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")  # no trailers
        elif "content-length" in headers:
            watch.feed(await self.reader.readexactly(int(headers["content-length"])), time.perf_counter())
        else:  # delimited by the close
            while data := await self.reader.read(65536):
                watch.feed(data, time.perf_counter())
        sample.total_ms = (time.perf_counter() - t0) * 1000
        if headers.get("connection", "").lower() == "close":
            self._drop()

    def _drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def close(self) -> None:
        self._drop()


@dataclass
class _H2Stream:
    sample: Sample
    t0: float
    watch: SseWatch
    done: asyncio.Event = field(default_factory=asyncio.Event)


class H2Client:
    """One HTTP/2 connection (ALPN h2) for every request, like Codex; a new one only if the proxy ends it."""

    def __init__(self, proxy_port: int, authority: str, ca: Path):
        self.proxy_port, self.authority, self.ca = proxy_port, authority, ca
        self.conn: h2.connection.H2Connection | None = None
        self.writer = None
        self.reader_task: asyncio.Task | None = None
        self.streams: dict[int, _H2Stream] = {}
        self.window = asyncio.Event()
        self.goaway = False  # the proxy said it takes no new streams on this connection
        self.connections = 0

    async def _ensure(self, sample: Sample) -> None:
        if self.conn is not None and not self.goaway and self.reader_task is not None and not self.reader_task.done():
            return
        if self.conn is not None:
            await self.close()
        t0 = time.perf_counter()
        reader, self.writer = await tunnel(self.proxy_port, self.authority, self.ca, ["h2", "http/1.1"])
        alpn = self.writer.get_extra_info("ssl_object").selected_alpn_protocol()
        if alpn != "h2":
            self.writer.close()
            raise ConnectionError(f"the proxy negotiated {alpn!r}, not h2")
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.goaway = False
        self.writer.write(self.conn.data_to_send())
        self.reader_task = asyncio.create_task(self._read(reader, self.writer, self.conn))
        self.connections += 1
        sample.new_connection, sample.setup_ms = True, (time.perf_counter() - t0) * 1000

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn) -> None:
        try:
            while data := await reader.read(65536):
                now = time.perf_counter()
                for event in conn.receive_data(data):
                    self._on(conn, event, now)
                writer.write(conn.data_to_send())
        except (OSError, h2.exceptions.ProtocolError) as exc:
            for st in self.streams.values():
                st.sample.error = st.sample.error or f"connection: {type(exc).__name__}: {exc}"
        finally:
            for st in self.streams.values():  # the connection is gone: nothing more comes
                st.done.set()
            self.window.set()

    def _on(self, conn, event, now: float) -> None:
        st = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and st:
            st.sample.first_byte_ms = (now - st.t0) * 1000
            st.sample.status = int(dict(event.headers).get(":status", 0))
        elif isinstance(event, h2.events.DataReceived):
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if st:
                st.watch.feed(event.data, now)
        elif isinstance(event, h2.events.StreamEnded) and st:
            st.sample.total_ms = (now - st.t0) * 1000
            st.done.set()
        elif isinstance(event, h2.events.StreamReset) and st:
            st.sample.error = f"stream reset (error code {event.error_code})"
            st.done.set()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self.window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = True

    async def post(self, sample: Sample, token: str, body: bytes) -> None:
        await self._ensure(sample)
        conn = self.conn
        sid = conn.get_next_available_stream_id()
        t0 = time.perf_counter()
        st = self.streams[sid] = _H2Stream(sample, t0, SseWatch(sample, t0))
        sample.sent_at = time.time()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", self.authority),
                                (":path", "/v1/responses"), *request_headers(token, sample.session),
                                ("content-length", str(len(body)))])
        try:
            await self._send_body(sid, body, t0)
            await asyncio.wait_for(st.done.wait(), max(0.01, REQUEST_TIMEOUT - (time.perf_counter() - t0)))
        finally:
            self.streams.pop(sid, None)

    async def _send_body(self, sid: int, body: bytes, t0: float) -> None:
        """DATA frames within the peer's flow-control windows (16 KiB fits the initial 64 KiB one)."""
        view = memoryview(body)
        while view:
            n = min(len(view), self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if n <= 0:
                self.window.clear()
                await asyncio.wait_for(self.window.wait(), max(0.01, REQUEST_TIMEOUT - (time.perf_counter() - t0)))
                continue
            self.conn.send_data(sid, bytes(view[:n]))
            view = view[n:]
        self.conn.end_stream(sid)
        self.writer.write(self.conn.data_to_send())

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close_connection()
                self.writer.write(self.conn.data_to_send())
            self.writer.close()
        if self.reader_task is not None:
            self.reader_task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.reader_task, 2)
        self.conn = self.reader_task = None


# -- the processes ----------------------------------------------------------------------------

@dataclass
class Cell:
    """One proxy under test with its client: a configuration x a client variant."""
    index: int
    client: str
    config: str
    folder: Path
    proc: subprocess.Popen | None = None
    agent: H1Client | H2Client | None = None

    @property
    def proxy_port(self) -> int:
        return PROXY_PORT0 + self.index

    @property
    def front_port(self) -> int:
        return FRONT_PORT0 + self.index

    @property
    def authority(self) -> str:
        return f"{HOST}:{self.front_port}"

    @property
    def ca(self) -> Path:
        return self.folder / "conf" / "mitmproxy-ca-cert.pem"


def wait_listening(link: DelayLink, side: str, port: int, proc: subprocess.Popen, what: str,
                   timeout: float = START_TIMEOUT) -> None:
    """Until something accepts on 127.0.0.1:`port` in namespace `side` (bounded; fails if `proc` exits)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with link.inside(side):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing listening on port {port} after {timeout:g} s")
        time.sleep(0.05)


def spawn(link: DelayLink, side: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
    """A process in namespace `side`, its output in `log`, in its own session (a Ctrl-C reaches only us:
    we stop it by PID, in order)."""
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return link.run_in(side, argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                           env={**os.environ, **(env or {})})


def start_upstream(link: DelayLink, tmp: Path, cells: list[Cell], server_pem: Path, pace: float,
                   deltas: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Namespace b: the fake upstream (plain HTTP/1.1 on 127.0.0.1) and the TLS front before it."""
    fake = spawn(link, "b", [PYTHON, str(ROOT / "tests" / "support" / "fake_upstream.py"), "--port", str(FAKE_PORT),
                             "--log", str(tmp / "fake.jsonl"), "--pace", str(pace), "--deltas", str(deltas), "--trace-events"],
                 tmp / "fake.out")
    (tmp / "front_log.py").write_text(FRONT_ADDON)
    modes = [a for c in cells for a in ("--mode", f"reverse:http://127.0.0.1:{FAKE_PORT}@{c.front_port}")]
    front = spawn(link, "b", [MITMDUMP, *modes, "--certs", f"*={server_pem}", "--set", f"confdir={tmp / 'front-conf'}",
                              "--set", "stream_large_bodies=1", "-s", str(tmp / "front_log.py")],
                  tmp / "front.log", {"CFBENCH_FRONT_LOG": str(tmp / "front.jsonl")})
    wait_listening(link, "b", FAKE_PORT, fake, "fake upstream")
    for c in cells:
        wait_listening(link, "b", c.front_port, front, "TLS front")
    return fake, front


def start_proxy(link: DelayLink, cell: Cell, ca: Path, addon: Path) -> None:
    """Namespace a: the proxy under test, as scripts/bench.py runs it (its own temporary confdir and state)."""
    cell.folder.mkdir(parents=True, exist_ok=True)
    args = [MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(cell.proxy_port),
            "--set", f"confdir={cell.folder / 'conf'}", "--set", f"ssl_verify_upstream_trusted_ca={ca}"]
    env = {"XDG_STATE_HOME": str(cell.folder / "state")}  # never the user's ~/.local/state
    if cell.config == "plain":
        args += ["--set", "stream_large_bodies=1"]
    else:
        text, pool_env = pool_yaml(f"https://{cell.authority}", [("spare", SPARE_KEY)], overload_cooldown="1s")
        if cell.config in FAILING:  # (a baseline from before the overload section gets no failover cell)
            text += OVERLOAD_REST
        (cell.folder / "pool.yaml").write_text(text)
        args += ["-s", str(addon), "--set", f"failover_config={cell.folder / 'pool.yaml'}"]
        env |= pool_env
    cell.proc = spawn(link, "a", args, cell.folder / "mitmdump.log", env)


def check_front_h2(link: DelayLink, port: int, ca: Path) -> str:
    """The front must offer h2 to an h2 client (as chatgpt.com does): the ALPN it selects."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with link.inside("a"), socket.create_connection((link.addr["b"], port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            return tls.selected_alpn_protocol() or "none"


# -- the run ----------------------------------------------------------------------------------

# The failover cells' own key is overloaded on every request and must be tried on the next one too:
# it rests 1 ms, never longer (no streak).
OVERLOAD_REST = "overload:\n  first: 1ms\n  factor: 1\n"


def token_for(cell: Cell, rtt: float, i: int) -> str:
    """One key per cell, as a user has one: kept connections are per credential, so the own
    key's connection is warm, as it is for a user whose account starts to fail. (The failover cells'
    pool rests an overloaded key 1 ms: `overload_rest`.) Nothing in it may name another fake scenario."""
    kind = "overload" if cell.config in FAILING else "good"
    return f"sk-test-{cell.config}-{kind}-{cell.client}-r{rtt:g}"


async def one(cell: Cell, rtt: float, i: int, body_text: str) -> Sample:
    s = Sample(rtt, cell.client, cell.config, f"lat-{cell.client}-{cell.config}-r{rtt:g}-{i}")
    try:
        await asyncio.wait_for(cell.agent.post(s, token_for(cell, rtt, i), request_body(s.session, body_text)),
                               REQUEST_TIMEOUT + 5)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, h2.exceptions.H2Error) as exc:
        s.error = s.error or f"{type(exc).__name__}: {exc}"
    return s


async def run_phase(link: DelayLink, cells: list[Cell], rtt: float, requests: int, warmup: int,
                    body_text: str) -> tuple[list[Sample], dict]:
    """One RTT: warm-ups per cell, then `requests` rounds of one request per cell, the order rotating."""
    for c in cells:
        for w in range(warmup):
            s = await one(c, rtt, -1 - w, body_text)
            if not s.ok:
                raise RuntimeError(f"warm-up through {c.client}/{c.config} failed: {s.error or s.status}")
    syn0, conns0 = link.stats()["syn_to_b"], {c.index: c.agent.connections for c in cells}
    samples = []
    for i in range(requests):
        k = i % len(cells)
        for c in cells[k:] + cells[:k]:
            samples.append(await one(c, rtt, i, body_text))
    syn1 = link.stats()["syn_to_b"]
    counts = {c.index: {"syn": syn1.get(c.front_port, 0) - syn0.get(c.front_port, 0),
                        "client_conns": c.agent.connections - conns0[c.index]} for c in cells}
    return samples, counts


def attach_upstream_times(samples: list[Sample], fake_log: Path) -> None:
    """Request sent -> the fake received the (first) attempt, and for failovers the spare's."""
    first: dict[str, float] = {}
    spare: dict[str, float] = {}
    written: dict[tuple[str, int], float] = {}  # (response id, sequence number) -> the fake wrote it
    for line in fake_log.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "event_sent":
            written[(r["response"], r["seq"])] = r["ts"]
        if "event" in r or not r.get("session"):
            continue
        first.setdefault(r["session"], r["ts"])
        if r.get("credential") == SPARE_KEY:
            spare.setdefault(r["session"], r["ts"])
    for s in samples:
        if s.session in first:
            s.to_upstream_ms = (first[s.session] - s.sent_at) * 1000
        if s.config in FAILING and s.session in spare:
            s.to_spare_ms = (spare[s.session] - s.sent_at) * 1000
        wrote = written.get((s.response_id, s.first_output_seq))
        if wrote is not None and s.first_output_wall is not None:
            s.output_hop_ms = (s.first_output_wall - wrote) * 1000


def attach_reject_to_spare(samples: list[Sample], fake_log: Path, front_log: Path) -> None:
    """For failovers: when the fake wrote the own key's rejection (its `error` event) and when the
    spare's request reached the front (the session's second request there)."""
    if not front_log.exists():
        return
    fake = [json.loads(line) for line in fake_log.read_text().splitlines()]
    errors = sorted((r["ts"], r["credential"]) for r in fake if r.get("event") == "event_sent" and r.get("type") == "error")
    requests = {}
    for r in fake:
        if "event" not in r and r.get("session"):
            requests.setdefault(r["session"], []).append(r)
    at_front: dict[str, list[float]] = {}
    for line in front_log.read_text().splitlines():
        r = json.loads(line)
        at_front.setdefault(r.get("session", ""), []).append(r["ts"])
    for s in samples:
        own, fronts = requests.get(s.session, []), sorted(at_front.get(s.session, []))
        if s.config not in FAILING or len(own) < 2 or len(fronts) < 2:
            continue
        start, cred = own[0]["ts"], own[0]["credential"]
        rejected = next((ts for ts, c in errors if c == cred and start <= ts <= own[1]["ts"]), None)
        if rejected is not None:
            s.reject_to_spare_ms = (fronts[1] - rejected) * 1000 - s.rtt


def front_view(front_log: Path, samples: list[Sample]) -> dict[tuple[float, int], dict]:
    """Per (RTT, front port), over the measured requests (by session): the requests the front received
    (attempts), the connections that were new (their first request was a measured one: a connection
    opened by a warm-up and reused is not new) and the HTTP versions."""
    rtt_of = {s.session: s.rtt for s in samples}
    out: dict[tuple[float, int], dict] = {}
    seen: set[str] = set()
    if not front_log.exists():
        return out
    for line in front_log.read_text().splitlines():
        r = json.loads(line)
        new = r["conn"] not in seen
        seen.add(r["conn"])
        if r.get("session") not in rtt_of:
            continue
        v = out.setdefault((rtt_of[r["session"]], r["port"]), {"requests": 0, "new_conns": 0, "http": set()})
        v["requests"] += 1
        v["new_conns"] += new
        v["http"].add(r["http"])
    return out


# -- reporting --------------------------------------------------------------------------------

def values(samples: list[Sample], name: str) -> list[float]:
    return [getattr(s, name) for s in samples if s.ok and getattr(s, name) is not None]


def summarize(samples: list[Sample], counts: dict, front: dict, cells: list[Cell], rtts: list[float]) -> list[dict]:
    rows = []
    for rtt in rtts:
        for c in cells:
            mine = [s for s in samples if s.rtt == rtt and s.client == c.client and s.config == c.config]
            ok = [s for s in mine if s.ok]
            n = max(1, len(mine))
            fv = front.get((rtt, c.front_port), {"requests": 0, "new_conns": 0, "http": set()})
            row = {"rtt_ms": rtt, "client": c.client, "config": c.config, "requests": len(mine), "ok": len(ok),
                   "upstream_syn_per_request": counts[rtt][c.index]["syn"] / n,
                   "front_conns_per_request": fv["new_conns"] / n, "attempts_per_request": fv["requests"] / n,
                   "front_http": sorted(fv["http"]),
                   "client_conns_per_request": counts[rtt][c.index]["client_conns"] / n,
                   "setup_ms": med([s.setup_ms for s in mine if s.setup_ms is not None]),
                   "errors": [s.error or f"status {s.status}, completed={s.completed}" for s in mine if not s.ok]}
            for name in ("first_byte_ms", "first_output_ms", "first_text_ms", "total_ms", "to_upstream_ms",
                         "to_spare_ms", "reject_to_spare_ms", "output_hop_ms"):
                v = values(mine, name)
                row[name] = {"median": med(v), "p95": pct(v, 0.95), "n": len(v)}
            rows.append(row)
    for row in rows:  # the difference of each median to plain mitmdump's, same RTT and client
        if row["config"] == "plain":
            continue
        base = next(r for r in rows if r["rtt_ms"] == row["rtt_ms"] and r["client"] == row["client"]
                    and r["config"] == "plain")
        for name in ("first_byte_ms", "first_output_ms", "first_text_ms", "to_upstream_ms", "output_hop_ms"):
            row[name]["delta_vs_plain"] = row[name]["median"] - base[name]["median"]
    return rows


def fmt(stat: dict, delta: bool = True) -> str:
    """median/p95 [difference of the median to plain mitmdump's]."""
    if not stat["n"]:
        return f"{'-':<21}"
    d = f" {stat['delta_vs_plain']:+7.1f}" if delta and "delta_vs_plain" in stat else " " * 8 * delta
    return f"{stat['median']:6.1f}/{stat['p95']:6.1f}{d}"


def print_tables(rows: list[dict], busy: dict[float, float], configs: dict[str, str]) -> None:
    print("\nconfigs: " + "; ".join(f"{k} = {v}" for k, v in configs.items()))
    print("\n== latency, ms: median/p95 and the median's difference to plain mitmdump (same RTT, same client) ==")
    print(f"{'RTT':>4} {'cli':<3} {'config':<8} {'ok':>5}  {'(a) first byte':<21}  {'(b) first output':<21}  "
          f"{'(c) first text delta':<21}  {'to upstream':<21}  {'(d) first output hop':<21}")
    for r in rows:
        print(f"{r['rtt_ms']:>4g} {r['client']:<3} {r['config']:<8} {r['ok']:>2}/{r['requests']:<2}  "
              f"{fmt(r['first_byte_ms'])}  {fmt(r['first_output_ms'])}  {fmt(r['first_text_ms'])}  "
              f"{fmt(r['to_upstream_ms'])}  {fmt(r['output_hop_ms'])}")
    print("\n== per measured request: new upstream TCP connections (SYNs on the link; new connections at the front), "
          "attempts at the front, new client connections; the HTTP version upstream; failover: sent -> spare, "
          "and the proxy's own time from the rejection to the spare's request (the fake wrote the rejection -> "
          "the spare's request at the front, less one RTT) ==")
    print(f"{'RTT':>4} {'cli':<3} {'config':<8} {'SYN/req':>8} {'front conns/req':>15} {'attempts/req':>12} "
          f"{'client conns/req':>16} {'upstream http':>13}  {'to spare':<13}  {'rejection -> spare':<13}")
    for r in rows:
        spare = fmt(r["to_spare_ms"], delta=False) if r["to_spare_ms"]["n"] else "-"
        turn = r.get("reject_to_spare_ms") or {"n": 0}
        turn = fmt(turn, delta=False) if turn["n"] else "-"
        print(f"{r['rtt_ms']:>4g} {r['client']:<3} {r['config']:<8} {r['upstream_syn_per_request']:8.2f} "
              f"{r['front_conns_per_request']:15.2f} {r['attempts_per_request']:12.2f} "
              f"{r['client_conns_per_request']:16.2f} {','.join(r['front_http']) or '-':>13}  {spare}  {turn}")
    print("\nhost CPUs busy while measuring (every process on the machine): "
          + ", ".join(f"RTT {rtt:g} ms {b * 100:.0f}%" for rtt, b in busy.items()))


def chart(rows: list[dict], rtts: list[float], path: Path, configs: dict[str, str], caption: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "#7f7f7f", "healthy": "#1f77b4", "failover": "#ff7f0e", "baseline": "#2ca02c",
              "base-failover": "#d62728"}
    groups = [(rtt, cl) for rtt in rtts for cl in CLIENTS]
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(2.4 * len(groups) + 2, 4.6))
    top = 0.0
    for k, cfg in enumerate(configs):
        xs, ys, errs = [], [], []
        for i, (rtt, cl) in enumerate(groups):
            r = next((r for r in rows if r["rtt_ms"] == rtt and r["client"] == cl and r["config"] == cfg), None)
            if r is None or not r["first_text_ms"]["n"]:
                continue
            xs.append(i + (k - (len(configs) - 1) / 2) * width)
            ys.append(r["first_text_ms"]["median"])
            errs.append(max(0.0, r["first_text_ms"]["p95"] - r["first_text_ms"]["median"]))
        bars = ax.bar(xs, ys, width, yerr=[[0.0] * len(errs), errs], capsize=3, color=colors[cfg],
                      label=f"{cfg}: {configs[cfg]}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        top = max([top] + [y + e for y, e in zip(ys, errs, strict=False)])
    ax.set_ylim(0, top * (1.2 + 0.06 * len(configs)))  # room above the bars for the legend
    ax.set_xticks(range(len(groups)), [f"RTT {rtt:g} ms\nclient {cl}" for rtt, cl in groups])
    ax.set_ylabel("ms, request sent -> first text delta")
    ax.set_title("time to first text delta through the proxy, upstream behind TLS (median, whisker to p95)",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.text(0.99, 0.01, caption, ha="right", va="bottom", fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat: other work on the machine skews latencies."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def no_nan(obj):
    """JSON has no NaN: a statistic without values is null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_nan(v) for v in obj]
    return obj


def versions(addon: Path = ROOT / "addon" / "failover.py") -> str:
    def ver(name: str) -> str:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
        return "?"

    where = str(addon)
    if addon.resolve() == (ROOT / "addon" / "failover.py").resolve():
        try:
            commit = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "addon"], capture_output=True,
                                   text=True, timeout=10).stdout.strip()
            where = f"this checkout at {commit or '?'}{' + uncommitted changes in addon/' if dirty else ''}"
        except (OSError, subprocess.SubprocessError):
            where = "this checkout"
    return (f"mitmproxy {ver('mitmproxy')}, h2 {ver('h2')}, python {platform.python_version()}, "
            f"kernel {platform.release()}, {os.cpu_count()} CPUs; addon: {where}")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__.splitlines()
    ap = argparse.ArgumentParser(prog="scripts/bench --latency", description=doc[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(doc[2:]))
    ap.add_argument("--quick", action="store_true", help="smoke run: few requests per cell (under 90 s)")
    ap.add_argument("--rtt", default="0,30", help="round-trip times in ms, comma-separated (default 0,30)")
    ap.add_argument("--requests", type=int, help="measured requests per cell (default 40; --quick 8)")
    ap.add_argument("--warmup", type=int, help="warm-up requests per cell and RTT (default 3; --quick 1)")
    ap.add_argument("--pace", type=float, default=0.01, help="seconds between the fake's events (default 0.01)")
    ap.add_argument("--deltas", type=int, default=8, help="text deltas per answer (default 8)")
    ap.add_argument("--body-kib", type=int, default=16, help="size of each request's input text (default 16)")
    ap.add_argument("--json", type=Path, help="also write every measurement to this file")
    ap.add_argument("--png", type=Path, help="chart (default docs/bench-latency.png; with --quick a temp file)")
    ap.add_argument("--addon", type=Path, default=ROOT / "addon" / "failover.py",
                    help="the failover.py to load (default: this checkout's); e.g. from `git archive OLD addon`, "
                         "whose own codex_failover package it then imports, to compare commits")
    ap.add_argument("--baseline", type=Path, metavar="FAILOVER_PY",
                    help="also run this failover.py (healthy) as the `baseline` configuration, interleaved with "
                         "this checkout's: a change measured A/B in one run (`git archive OLD addon rules | tar -x "
                         "-C /tmp/old`, then --baseline /tmp/old/addon/failover.py)")
    ap.add_argument("--baseline-failover", action="store_true",
                    help="with --baseline: its failover too (`base-failover`: own cred overloaded), for an A/B of "
                         "the failover path")
    ap.add_argument("--from-json", type=Path, metavar="FILE", help="measure nothing: report a --json FILE again")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs of every process)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        if why := available():
            print(f"bench --latency cannot run here: {why}", file=sys.stderr)
            return 2
        for name, path in (("--addon", args.addon), ("--baseline", args.baseline)):
            if path is not None and not path.is_file():
                print(f"bench --latency: {name} {path}: no such file (a failover.py)", file=sys.stderr)
                return 2
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
        doc = run(args)
        if args.json:
            args.json.write_text(json.dumps(no_nan(doc), indent=1))
    png = args.png or (Path(tempfile.gettempdir()) / "codex-failover-bench-latency-quick.png" if args.quick
                       else ROOT / "docs" / "bench-latency.png")
    return report(doc, png)


def run(args: argparse.Namespace) -> dict:
    """Measure every cell; everything the report needs (and --json writes)."""
    rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
    requests = args.requests or (8 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    size = args.body_kib * 1024
    body_text = ("Refactor the parser and keep the tests green. " * (size // 46 + 1))[:size]
    began = time.monotonic()
    about = versions(args.addon) + (f"; baseline: {args.baseline}" if args.baseline else "")
    print(f"codex-failover latency benchmark{' (quick)' if args.quick else ''}: {about}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="codex-failover-bench-latency-"))
    try:
        with DelayLink(rtt_ms=rtts[0]) as link:
            cells, samples, counts, front, busy = measure(link, tmp, rtts, requests, warmup, body_text, args)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", str(tmp)], timeout=60)
    method = (f"{len(samples)} measured requests ({requests} per cell, {warmup} warm-up per cell and RTT, one at a "
              f"time, interleaved) in {time.monotonic() - began:.0f} s; fake: {args.deltas} text deltas, "
              f"{args.pace * 1000:g} ms between events; {args.body_kib} KiB input")
    return {"versions": about, "method": method, "rtts": rtts, "host_busy": [[r, b] for r, b in busy.items()],
            "configs": configs_of(args), "rows": summarize(samples, counts, front, cells, rtts),
            "samples": [asdict(s) for s in samples]}


def configs_of(args: argparse.Namespace) -> dict[str, str]:
    if args.baseline is None:
        return dict(CONFIGS)
    both = {"baseline": f"addon at {args.baseline}, healthy"}
    if args.baseline_failover:
        both["base-failover"] = f"addon at {args.baseline}, own cred overloaded"
    return {**CONFIGS, **both}


def report(doc: dict, png: Path) -> int:
    """Tables, chart and errors of a run (just measured, or read back with --from-json)."""
    print(f"\n{doc['method']}")
    configs = doc.get("configs", CONFIGS)
    print_tables(doc["rows"], dict(doc["host_busy"]), configs)
    chart(doc["rows"], doc["rtts"], png, configs, doc["versions"])
    print(f"\nchart: {png}")
    errors = [(r, e) for r in doc["rows"] for e in r["errors"]]
    for r, e in errors[:10]:
        print(f"error: RTT {r['rtt_ms']:g} {r['client']} {r['config']}: {e}", file=sys.stderr)
    return 1 if errors else 0


def measure(link: DelayLink, tmp: Path, rtts: list[float], requests: int, warmup: int, body_text: str,
            args: argparse.Namespace):
    ca, server_pem = make_test_pki(tmp, names=(HOST,))
    link.hosts("a", {HOST: link.addr["b"]})
    cells = [Cell(i, cl, cfg, tmp / f"{cl}-{cfg}") for i, (cl, cfg) in
             enumerate((cl, cfg) for cl in CLIENTS for cfg in configs_of(args))]
    start_upstream(link, tmp, cells, server_pem, args.pace, args.deltas)
    for c in cells:  # all at once: mitmdump takes a second or two to start
        start_proxy(link, c, ca, args.baseline if c.config in ("baseline", "base-failover") else args.addon)
    for c in cells:
        wait_listening(link, "a", c.proxy_port, c.proc, f"mitmdump ({c.client}, {c.config})")
    print(f"TLS front (mitmdump reverse) selects ALPN {check_front_h2(link, cells[0].front_port, ca)!r} "
          f"for a client offering h2 and http/1.1", flush=True)
    samples: list[Sample] = []
    counts: dict[float, dict] = {}
    busy: dict[float, float] = {}
    with link.inside("a"):  # the clients' sockets live in namespace a, next to the proxies
        for rtt in rtts:
            link.set_rtt(rtt)
            time.sleep(0.2)  # packets queued at the previous delay drain first (the link keeps order)
            for _ in range(LINK_TRIES):  # a busy moment of the host slows the user-space link: measured again
                conn = link.connect_ms(samples=7)
                print(f"RTT {rtt:g} ms: TCP connect a->b {statistics.median(conn):.2f} ms median "
                      f"(min {min(conn):.2f}, max {max(conn):.2f})", flush=True)
                if abs(statistics.median(conn) - rtt) <= 5 + 0.1 * rtt:
                    break
                time.sleep(1.0)
            else:  # the link is not what the numbers would claim
                raise RuntimeError(f"a TCP connect across the link should take about {rtt:g} ms "
                                   f"({LINK_TRIES} tries; is the host busy?)")
            t, host0 = time.monotonic(), host_jiffies()
            got, counts[rtt] = asyncio.run(phase(link, cells, rtt, requests, warmup, body_text))
            host1 = host_jiffies()
            busy[rtt] = (host1[0] - host0[0]) / max(1, host1[1] - host0[1])
            samples += got
            print(f"  {len(got)} requests in {time.monotonic() - t:.0f} s, "
                  f"{sum(not s.ok for s in got)} failed", file=sys.stderr, flush=True)
    attach_upstream_times(samples, tmp / "fake.jsonl")
    attach_reject_to_spare(samples, tmp / "fake.jsonl", tmp / "front.jsonl")
    return cells, samples, counts, front_view(tmp / "front.jsonl", samples), busy


async def phase(link: DelayLink, cells: list[Cell], rtt: float, requests: int, warmup: int, body_text: str):
    """One RTT with fresh client connections (its warm-ups open them)."""
    for c in cells:
        c.agent = (H2Client if c.client == "h2" else H1Client)(c.proxy_port, c.authority, c.ca)
    try:
        return await run_phase(link, cells, rtt, requests, warmup, body_text)
    finally:
        for c in cells:
            await c.agent.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted (namespaces and processes cleaned up)", file=sys.stderr)
        sys.exit(130)
