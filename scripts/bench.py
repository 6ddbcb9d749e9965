#!/usr/bin/env python3
"""Proxy benchmark: plain mitmdump against the codex-failover addon, side by side in one run, on 127.0.0.1.

Configurations, each its own mitmdump process (temporary confdir), all against one fake upstream:
  (a) plain mitmdump, no addon, bodies streamed (--set stream_large_bodies=1; otherwise mitmproxy buffers)
  (b) mitmdump -s addon/failover.py with a pool (one spare), the client's own credential healthy
  (c) the addon, the client's own credential overloaded after response.created, the spare good
  (p) with --pool-only: the addon in pool-only mode (`use_client_credential: false`): every attempt on the
      pooled spare, over the addon's kept upstream connections (a second flow each), none on the client's
      own stream; with --baseline too, (q) the baseline's addon in pool-only mode

Each stream is a full Codex-like POST …/responses (absolute-form http:// URL, raw asyncio sockets, a
16 KiB input, a unique credential and session-id per stream) answered with reasoning + text events.
Two paces: a realistic one (25 ms between events, per-event timestamps from the fake's --trace-events)
and 0 (the fake writes as fast as it can, to stress the proxy). For each concurrency level C, C client
workers each run `rounds` streams back to back; a level with several blocks runs the configurations in
turns, block by block (a, b, c, a, b, c, ...), so drift hits them alike, and merges the blocks. At the
realistic pace the workers' first starts are spread over one stream's duration, so C streams are in
flight in a steady state (not a burst of C simultaneous requests); at pace 0 they all start at once.

Reported per configuration and concurrency (ms: median / p95):
- first byte: request sent -> first response byte at the client. With the addon this is the commit
  of the held stream (the first output event), so it is not comparable with (a);
- first output: request sent -> the first output event (reasoning or text delta) at the client:
  the fair comparison; "to upstream": request sent -> its (first) attempt arrived at the fake;
  "1st out hop": the fake wrote the first output event -> the client has it;
- live events: the fake wrote an event -> the client has it, for every event from the first output on
  (the per-event cost of streaming through the proxy once committed);
- events/s through the proxy (events the clients received / wall time of the run);
- CPU of the mitmdump process (its threads' time on a CPU, /proc/PID/task/*/schedstat) per 1,000 events
  delivered, and per request (the block's CPU / its streams);
- memory: RSS before the run, peak during it (VmHWM, reset per block through /proc/PID/clear_refs),
  RSS after (MiB), and the peak's ratio to (a)'s; MB per concurrent stream = (peak - RSS before) / C
  (the block that grew most);
- proxy CPU: the mitmdump process's CPU time / wall time (its event loop is one thread: near 100%
  it is saturated and latencies are queueing); host busy: how busy all CPUs were during the run
  (/proc/stat; the fake, the client and anything else running count too);
- (c) failover: the fake wrote the rejection -> the spare's request arrived at the fake.

Timestamps from different processes are wall-clock (time.time()) on one machine.

    scripts/bench [--quick] [--pool-only] [--png docs/bench.png] [--json FILE]
    scripts/bench --cost [--sessions N] [--pool-only] [--baseline OTHER/addon/failover.py ...]   (scripts/bench_cost.py)
    scripts/bench --instructions [--requests N] [--baseline OTHER/addon/failover.py ...]   (scripts/bench_instructions.py)
    scripts/bench --ab OTHER/addon/failover.py [...] [--instances 3] [--length short] [--pool-only]  (scripts/bench_ab.py)
    scripts/bench --session [--turns 10 30] [--uplink-mbit 10] [--rtt-ms 30]       (scripts/bench_session.py)
    scripts/bench --where [--requests 4000] [--length short] [--top 40]   (scripts/bench_where.py)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import ROOT, FakeUpstreamProcess, ProxyProcess, med, pct, pool_yaml

CONFIGS = {
    "a": "plain mitmdump, streaming",
    "b": "addon, healthy",
    "c": "addon, 1st cred overloaded",
}
FAILING = ("c", "e")  # the configurations whose first credential is overloaded
BASELINE = {"d": "baseline, healthy", "e": "baseline, 1st cred overloaded"}  # with --baseline
POOL_ONLY = {"p": "addon, pool only"}  # with --pool-only: use_client_credential false
POOL_ONLY_BASELINE = {"q": "baseline, pool only"}  # with --pool-only and --baseline
SPARE_KEY = "sk-test-spare-good"
OUTPUT_TYPES = {"response.reasoning_summary_text.delta", "response.output_text.delta"}
STREAM_TIMEOUT = 60.0  # seconds one stream may take at most
SETTLE = 0.3  # seconds for the fake's last trace lines to reach its log after the clients finished

# Goals (issue "Measure it")
GOAL_FIRST_OUTPUT_MS = 5.0  # (b) median time to first output at most this much above (a)'s
GOAL_THROUGHPUT_RATIO = 0.7  # (b) events/s at least this fraction of (a)'s (fast pace)
GOAL_MB_PER_STREAM = 1.0  # (b), (c) peak memory growth per concurrent stream at the highest concurrency
GOAL_PEAK_RATIO = 1.3  # (b), (p) peak RSS at the highest concurrency at most this times (a)'s (issue 45)


@dataclass
class Pace:
    name: str
    seconds: float
    deltas: int
    levels: list[tuple[int, int, int]]  # (concurrency, rounds, blocks): C workers x rounds streams, per block
    trace_events: bool
    stagger: bool  # spread the workers' first starts over one stream's duration (steady state, not a burst)

    @property
    def events_per_stream(self) -> int:  # what fake_upstream's Turn sends for a normal answer
        return self.deltas + max(1, self.deltas // 4) + 10


def plan(quick: bool) -> list[Pace]:
    if quick:
        return [Pace("realistic", 0.025, 16, [(1, 2, 1), (4, 1, 1)], True, True),
                Pace("fast", 0.0, 100, [(1, 2, 1), (4, 1, 1)], False, False)]
    return [Pace("realistic", 0.025, 16, [(1, 4, 6), (16, 2, 2), (64, 2, 2)], True, True),
            Pace("fast", 0.0, 200, [(1, 8, 4), (16, 2, 4), (64, 1, 4)], False, False)]


# -- the proxy process, from /proc ---------------------------------------------------------

class ProcStats:
    def __init__(self, pid: int):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        """utime + stime of the whole process (all threads), seconds."""
        with open(f"/proc/{self.pid}/stat") as fh:
            rest = fh.read().rpartition(")")[2].split()
        return (int(rest[11]) + int(rest[12])) / self.tick

    def run_time(self) -> float:
        """Seconds on a CPU of every live thread, from /proc/PID/task/*/schedstat (nanoseconds, where
        utime and stime count clock ticks of 10 ms: a block of requests is a few ticks). A thread that
        ended between two readings is missed (mitmdump's are long-lived); without schedstat (a kernel
        built without it), utime + stime."""
        total, read = 0, False
        for stat in Path(f"/proc/{self.pid}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0])
                read = True
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        return total / 1e9 if read else self.cpu()

    def mem(self) -> dict[str, float]:
        out = {}
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) / 1024  # MiB
        return out

    @staticmethod
    def host_jiffies() -> tuple[int, int]:
        """(busy, total) jiffies of all CPUs, from /proc/stat."""
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields) - idle, sum(fields)

    def reset_peak(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            return True
        except OSError:
            return False


# -- one client stream -----------------------------------------------------------------------

@dataclass
class Stream:
    token: str
    session: str
    started: float = 0.0
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    error: str | None = None
    # filled by decode()
    status: int = 0
    complete: bool = False
    events: list[tuple[float, str, int | None]] = field(default_factory=list)  # (arrival, type, sequence_number)
    response_id: str | None = None


def request_bytes(fake_port: int, token: str, session: str, input_text: str) -> bytes:
    body = json.dumps({
        "model": "gpt-fake", "stream": True, "store": False, "instructions": "You are a coding agent.",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": input_text}]}],
        "tools": [], "reasoning": {"effort": "medium", "summary": "auto"}, "prompt_cache_key": session,
    }).encode()
    head = (f"POST http://127.0.0.1:{fake_port}/v1/responses HTTP/1.1\r\n"
            f"host: 127.0.0.1:{fake_port}\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\n"
            f"accept: text/event-stream\r\nsession-id: {session}\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def one_stream(proxy_port: int, payload: bytes, stream: Stream) -> None:
    """Send the request and record every read with its arrival time; stops at the end of the body."""
    deadline = time.monotonic() + STREAM_TIMEOUT
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy_port), 10)
        stream.started = time.time()
        writer.write(payload)
        head_end, length, chunked, got, tail = -1, None, False, 0, b""
        buf = bytearray()
        while True:
            data = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            now = time.time()
            if not data:
                break
            stream.chunks.append((now, data))
            got += len(data)
            if head_end < 0:
                buf += data
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    continue
                head = bytes(buf[:head_end]).lower()
                chunked = b"transfer-encoding: chunked" in head
                for line in head.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                tail = bytes(buf[-7:])
                buf = bytearray()
            else:
                tail = (tail + data)[-7:]
            if chunked and tail == b"\r\n0\r\n\r\n":
                break
            if not chunked and length is not None and got >= head_end + 4 + length:
                break
    except (OSError, asyncio.TimeoutError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()


def decode(stream: Stream) -> None:
    """Status, de-chunked SSE events and when each event had fully arrived."""
    raw = b"".join(c for _, c in stream.chunks)
    ends = list(accumulate(len(c) for _, c in stream.chunks))
    times = [t for t, _ in stream.chunks]
    h = raw.find(b"\r\n\r\n")
    if h < 0:
        return
    stream.status = int(raw[:h].split(b" ", 2)[1])
    segs: list[tuple[int, int, int]] = []  # (body offset, raw offset, length)
    body = bytearray()
    if b"transfer-encoding: chunked" in raw[:h].lower():
        p = h + 4
        while True:
            e = raw.find(b"\r\n", p)
            if e < 0:
                break
            size = int(raw[p:e].split(b";")[0], 16)
            if size == 0:
                stream.complete = True
                break
            start = e + 2
            if start + size > len(raw):
                break
            segs.append((len(body), start, size))
            body += raw[start:start + size]
            p = start + size + 2
    else:
        segs.append((0, h + 4, len(raw) - h - 4))
        body += raw[h + 4:]
        stream.complete = True
    starts = [s[0] for s in segs]
    pos = 0
    while (q := body.find(b"\n\n", pos)) >= 0:
        last = q + 1
        i = bisect.bisect_right(starts, last) - 1
        arrived = times[min(len(times) - 1, bisect.bisect_right(ends, segs[i][1] + last - segs[i][0]))]
        for line in bytes(body[pos:q]).split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    obj = json.loads(line[5:])
                except ValueError:
                    continue
                kind = obj.get("type", "?")
                if stream.response_id is None and isinstance(obj.get("response"), dict):
                    stream.response_id = obj["response"].get("id")
                stream.events.append((arrived, kind, obj.get("sequence_number")))
        pos = q + 2


# -- one run: a configuration at a concurrency ----------------------------------------------

@dataclass
class Result:
    pace: str
    config: str
    concurrency: int
    streams: int
    ok: int
    errors: list[str]
    events: int
    wall_s: float
    cpu_s: float
    rss_before: float
    rss_after: float
    peak: float
    growth: float  # the largest rise of the peak above RSS before, over the blocks (MiB)
    host_busy: float  # share of all CPUs busy during the run (every process on the host)
    first_byte_ms: list[float]
    first_output_ms: list[float]
    dispatch_ms: list[float]
    hop_ms: list[float]
    live_ms: list[float]
    failover_ms: list[float]

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_per_1k(self) -> float:
        return self.cpu_s / (self.events / 1000) if self.events else math.nan

    @property
    def mb_per_stream(self) -> float:
        return self.growth / self.concurrency

    @property
    def cpu_ms_per_request(self) -> float:
        return self.cpu_s / self.ok * 1000 if self.ok else math.nan


def merge(parts: list[Result]) -> Result:
    """One result from the blocks of a configuration at a concurrency (run interleaved with the others')."""
    first = parts[0]
    out = Result(first.pace, first.config, first.concurrency, 0, 0, [], 0, 0.0, 0.0, first.rss_before,
                 parts[-1].rss_after, max(r.peak for r in parts), max(r.growth for r in parts),
                 sum(r.host_busy * r.wall_s for r in parts) / max(1e-9, sum(r.wall_s for r in parts)),
                 [], [], [], [], [], [])
    for r in parts:
        out.streams += r.streams
        out.ok += r.ok
        out.events += r.events
        out.wall_s += r.wall_s
        out.cpu_s += r.cpu_s
        for name in ("errors", "first_byte_ms", "first_output_ms", "dispatch_ms", "hop_ms", "live_ms", "failover_ms"):
            getattr(out, name).extend(getattr(r, name))
    return out


class FakeLog:
    """Reads the fake's JSON lines log incrementally."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict]:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        return [json.loads(x) for x in data[:cut].splitlines() if x.strip()]


def token_for(config: str, run: int, i: int) -> str:
    # Unique per stream (a credential's health is per token); nothing in it may name another scenario.
    return f"sk-test-{config}-{'overload' if config in FAILING else 'good'}-r{run}s{i}"


async def drive(proxy_port: int, fake_port: int, config: str, run: int, concurrency: int, rounds: int,
                input_text: str, spread: float) -> list[Stream]:
    streams: list[Stream] = []

    async def worker(w: int) -> None:
        await asyncio.sleep(w * spread / concurrency)
        for r in range(rounds):
            i = w * rounds + r
            s = Stream(token_for(config, run, i), f"bench-{config}-r{run}s{i}")
            streams.append(s)
            await one_stream(proxy_port, request_bytes(fake_port, s.token, s.session, input_text), s)

    await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(concurrency))), rounds * STREAM_TIMEOUT + 10)
    return streams


def run_once(pace: Pace, config: str, proxy: ProxyProcess, fake: FakeUpstreamProcess, log: FakeLog, run: int,
             concurrency: int, rounds: int, input_text: str) -> Result:
    stats = ProcStats(proxy.proc.pid)
    log.read_new()  # skip whatever came before
    rss_before = stats.mem()["VmRSS"]
    stats.reset_peak()
    cpu0 = stats.run_time()
    host0 = stats.host_jiffies()
    t0 = time.time()
    spread = pace.seconds * pace.events_per_stream if pace.stagger else 0.0
    streams = asyncio.run(drive(proxy.port, fake.port, config, run, concurrency, rounds, input_text, spread))
    t1 = max((s.chunks[-1][0] for s in streams if s.chunks), default=time.time())
    cpu1 = stats.run_time()
    host1 = stats.host_jiffies()
    mem = stats.mem()
    time.sleep(SETTLE)
    records = log.read_new()

    sent = {(r["response"], r["seq"]): r["ts"] for r in records if r.get("event") == "event_sent"}
    rejected = {r["credential"]: r["ts"] for r in records if r.get("event") == "rejection_sent"}
    spare_req: dict[str, float] = {}
    first_req: dict[str, float] = {}  # session -> when its first attempt arrived at the fake
    for r in records:
        if "event" not in r and r.get("session"):
            first_req.setdefault(r["session"], r["ts"])
            if r.get("credential") == SPARE_KEY:
                spare_req.setdefault(r["session"], r["ts"])

    res = Result(pace.name, config, concurrency, len(streams), 0, [], 0, t1 - t0, cpu1 - cpu0, rss_before,
                 mem["VmRSS"], mem["VmHWM"], mem["VmHWM"] - rss_before,
                 (host1[0] - host0[0]) / max(1, host1[1] - host0[1]), [], [], [], [], [], [])
    for s in streams:
        decode(s)
        ok = s.error is None and s.status == 200 and s.complete and s.events and s.events[-1][1] == "response.completed"
        if not ok:
            res.errors.append(s.error or f"status {s.status}, complete={s.complete}, {len(s.events)} events")
            continue
        res.ok += 1
        res.events += len(s.events)
        res.first_byte_ms.append((s.chunks[0][0] - s.started) * 1000)
        first = next(i for i, e in enumerate(s.events) if e[1] in OUTPUT_TYPES)
        res.first_output_ms.append((s.events[first][0] - s.started) * 1000)
        if s.session in first_req:
            res.dispatch_ms.append((first_req[s.session] - s.started) * 1000)
        if pace.trace_events:
            for j, (arrived, _, seq) in enumerate(s.events[first:]):
                ts = sent.get((s.response_id, seq))
                if ts is None:
                    continue
                res.live_ms.append((arrived - ts) * 1000)
                if j == 0:
                    res.hop_ms.append((arrived - ts) * 1000)
        if config in FAILING:
            label = s.token[:64]
            if label in rejected and s.session in spare_req:
                res.failover_ms.append((spare_req[s.session] - rejected[label]) * 1000)
    return res


# -- reporting --------------------------------------------------------------------------------

def mp(values: list[float]) -> str:
    return f"{med(values):6.1f}/{pct(values, 0.95):6.1f}" if values else f"{'-':>13}"


def ratio(x: float, base: float) -> str:
    if not (base and math.isfinite(base) and math.isfinite(x)):
        return "    -"
    return f"{x / base:5.2f}x"


def _rows(by: dict, pace):
    """(concurrency, config, its result, the plain-mitmdump result of that level) in table order."""
    for c, *_ in pace.levels:
        a = by.get((pace.name, c, "a"))
        for cfg in CONFIGS:
            r = by.get((pace.name, c, cfg))
            if r is not None:
                yield c, cfg, r, a


def print_tables(results: list[Result], paces: list[Pace], body_kib: int) -> None:
    by = {(r.pace, r.concurrency, r.config): r for r in results}
    for pace in paces:
        n_events = next((r.events // r.ok for r in results if r.pace == pace.name and r.ok), 0)
        print()
        print(f"== pace {pace.seconds * 1000:g} ms between events ({pace.name}); {n_events} events per stream "
              f"(reasoning + text, {pace.deltas} text deltas); {body_kib} KiB request body; ms as median / p95 ==")
        print(f"{'C':>3} {'config':<30} {'ok':>7} {'first byte':>13} {'first output':>13} {'vs a':>6} "
              f"{'to upstream':>13} {'1st out hop':>13} {'live events':>13} {'+vs a':>6} {'failover':>13}")
        for c, cfg, r, a in _rows(by, pace):
            fo_vs = ratio(med(r.first_output_ms), med(a.first_output_ms)) if a else "-"
            live_add = (f"{med(r.live_ms) - med(a.live_ms):+6.2f}" if a and r.live_ms and a.live_ms else f"{'-':>6}")
            print(f"{c:>3} ({cfg}) {CONFIGS[cfg]:<26} {r.ok:>3}/{r.streams:<3} {mp(r.first_byte_ms)} "
                  f"{mp(r.first_output_ms)} {fo_vs:>6} {mp(r.dispatch_ms)} {mp(r.hop_ms)} {mp(r.live_ms)} {live_add} "
                  f"{mp(r.failover_ms)}")
        print()
        print(f"{'C':>3} {'config':<30} {'events/s':>9} {'vs a':>6} {'CPU s/1k ev':>11} {'vs a':>6} "
              f"{'CPU ms/req':>10} {'vs a':>6} {'RSS before':>10} {'peak':>7} {'vs a':>6} {'RSS after':>9} "
              f"{'MB/stream':>9} {'proxy CPU':>9} {'host busy':>9}")
        for c, cfg, r, a in _rows(by, pace):
            print(f"{c:>3} ({cfg}) {CONFIGS[cfg]:<26} {r.events_per_s:9.0f} "
                  f"{ratio(r.events_per_s, a.events_per_s) if a else '-':>6} {r.cpu_per_1k:11.3f} "
                  f"{ratio(r.cpu_per_1k, a.cpu_per_1k) if a else '-':>6} {r.cpu_ms_per_request:10.2f} "
                  f"{ratio(r.cpu_ms_per_request, a.cpu_ms_per_request) if a else '-':>6} {r.rss_before:10.1f} "
                  f"{r.peak:7.1f} {ratio(r.peak, a.peak) if a else '-':>6} "
                  f"{r.rss_after:9.1f} {r.mb_per_stream:9.2f} {r.cpu_s / r.wall_s * 100 if r.wall_s else 0:8.0f}% "
                  f"{r.host_busy * 100:8.0f}%")


def checks(results: list[Result], paces: list[Pace]) -> list[tuple[bool, str]]:
    by = {(r.pace, r.concurrency, r.config): r for r in results}
    out = []
    real = next(p for p in paces if p.name == "realistic")
    fast = next(p for p in paces if p.name == "fast")
    for c, *_ in real.levels:
        a, b = by[(real.name, c, "a")], by[(real.name, c, "b")]
        d = med(b.first_output_ms) - med(a.first_output_ms)
        out.append((d <= GOAL_FIRST_OUTPUT_MS,
                    f"(b) first output at most {GOAL_FIRST_OUTPUT_MS:g} ms above (a), pace {real.seconds * 1000:g} ms, "
                    f"C={c}: {med(b.first_output_ms):.1f} vs {med(a.first_output_ms):.1f} ms median ({d:+.1f} ms)"))
    for c, *_ in fast.levels:
        a, b = by[(fast.name, c, "a")], by[(fast.name, c, "b")]
        q = b.events_per_s / a.events_per_s if a.events_per_s else math.nan
        out.append((q >= GOAL_THROUGHPUT_RATIO,
                    f"(b) throughput at least {GOAL_THROUGHPUT_RATIO:g}x (a), pace 0, C={c}: "
                    f"{b.events_per_s:.0f} vs {a.events_per_s:.0f} events/s ({q:.2f}x)"))
    top = max(c for c, *_ in real.levels)
    for cfg in ("b", "c"):
        r, a = by[(real.name, top, cfg)], by[(real.name, top, "a")]
        out.append((r.mb_per_stream <= GOAL_MB_PER_STREAM,
                    f"({cfg}) peak memory growth at most {GOAL_MB_PER_STREAM:g} MB per concurrent stream, "
                    f"pace {real.seconds * 1000:g} ms, C={top}: {r.mb_per_stream:.2f} MB/stream "
                    f"(+{r.growth:.1f} MB; (a): {a.mb_per_stream:.2f} MB/stream)"))
    for cfg in [c for c in ("b", "p") if (real.name, top, c) in by]:
        r, a = by[(real.name, top, cfg)], by[(real.name, top, "a")]
        out.append((r.peak <= GOAL_PEAK_RATIO * a.peak,
                    f"({cfg}) peak RSS at most {GOAL_PEAK_RATIO:g}x (a)'s, pace {real.seconds * 1000:g} ms, C={top}: "
                    f"{r.peak:.0f} vs {a.peak:.0f} MiB ({r.peak / a.peak:.2f}x)"))
    return out


def chart(results: list[Result], paces: list[Pace], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r.pace, r.concurrency, r.config): r for r in results}
    colors = {"a": "#7f7f7f", "b": "#1f77b4", "c": "#ff7f0e", "d": "#2ca02c", "e": "#d62728", "p": "#9467bd",
              "q": "#8c564b"}
    panels = [(p, "first_output") for p in paces] + [(p, "throughput") for p in paces if p.name == "fast"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.3))
    for ax, (pace, what) in zip(axes, panels, strict=False):
        levels = [c for c, *_ in pace.levels]
        width = 0.8 / len(CONFIGS)
        for k, cfg in enumerate(CONFIGS):
            xs, ys, errs = [], [], []
            for i, c in enumerate(levels):
                r = by.get((pace.name, c, cfg))
                if r is None:
                    continue
                xs.append(i + (k - 1) * width)
                if what == "first_output":
                    m = med(r.first_output_ms)
                    ys.append(m)
                    errs.append(max(0.0, pct(r.first_output_ms, 0.95) - m))
                else:
                    ys.append(r.events_per_s)
                    errs.append(0.0)
            ax.bar(xs, ys, width, yerr=[[0.0] * len(errs), errs] if what == "first_output" else None, capsize=3,
                   color=colors[cfg], label=f"({cfg}) {CONFIGS[cfg]}")
        ax.set_xticks(range(len(levels)), [f"C={c}" for c in levels])
        if what == "first_output":
            ax.set_title(f"time to first output event, pace {pace.seconds * 1000:g} ms\n(median, whisker to p95)", fontsize=10)
            ax.set_ylabel("ms")
        else:
            ax.set_title("throughput through the proxy, pace 0", fontsize=10)
            ax.set_ylabel("events/s received by clients")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("codex-failover vs plain mitmdump (127.0.0.1, fake upstream)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------

def warm_up(proxy: ProxyProcess, fake: FakeUpstreamProcess, config: str, input_text: str) -> None:
    async def go():
        ss = [Stream(token_for(config, 0, i), f"warm-{config}-{fake.port}-{i}") for i in range(4)]
        await asyncio.gather(*(one_stream(proxy.port, request_bytes(fake.port, s.token, s.session, input_text), s)
                               for s in ss))
        for s in ss:
            decode(s)
            if s.status != 200:
                tail = " | ".join(proxy.log().strip().splitlines()[-12:])  # why, when a loaded CI run meets it
                raise RuntimeError(f"warm-up through ({config}) failed: {s.error or s.status}; its log ends: {tail}")

    asyncio.run(go())


def main() -> int:
    if "--stores" in sys.argv[1:]:  # first-byte latency with each pool state store (scripts/bench_stores.py)
        import bench_stores

        return bench_stores.main([a for a in sys.argv[1:] if a != "--stores"])
    if "--cost" in sys.argv[1:]:  # CPU per request, idle CPU and RSS against plain mitmdump (scripts/bench_cost.py)
        import bench_cost

        return bench_cost.main([a for a in sys.argv[1:] if a != "--cost"])
    if "--ab" in sys.argv[1:]:  # an A/B of checkouts, several processes each (scripts/bench_ab.py)
        import bench_ab

        return bench_ab.main([a for a in sys.argv[1:] if a != "--ab"])
    if "--instructions" in sys.argv[1:]:  # instructions per request under callgrind (scripts/bench_instructions.py)
        import bench_instructions

        return bench_instructions.main([a for a in sys.argv[1:] if a != "--instructions"])
    if "--where" in sys.argv[1:]:  # where the addon's CPU a request goes, against plain (scripts/bench_where.py)
        import bench_where

        return bench_where.main([a for a in sys.argv[1:] if a != "--where"])
    if "--session" in sys.argv[1:]:  # a growing session over HTTP/SSE against the gated WebSocket (scripts/bench_session.py)
        import bench_session

        return bench_session.main([a for a in sys.argv[1:] if a != "--session"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 and 4, few streams (< 60 s)")
    ap.add_argument("--png", type=Path, help="chart path (default docs/bench.png; with --quick a file in the temp dir)")
    ap.add_argument("--json", type=Path, help="also write every measurement to this file")
    ap.add_argument("--body-kib", type=int, default=16, help="size of each request's input text (default 16)")
    ap.add_argument("--pool-only", action="store_true",
                    help="also run the addon in pool-only mode (use_client_credential: false) as (p): every attempt "
                         "over the kept upstream connections, none on the client's own stream")
    ap.add_argument("--baseline", type=Path, metavar="FAILOVER_PY",
                    help="also run another checkout's addon (`git archive OLD addon rules | tar -x -C /tmp/old`, then "
                         "/tmp/old/addon/failover.py) as (d) healthy and (e) overloaded: an A/B in one run")
    args = ap.parse_args()
    if args.baseline is not None:
        CONFIGS.update(BASELINE)  # the tables, the chart and the turns take every configuration
    if args.pool_only:
        CONFIGS.update(POOL_ONLY)
        if args.baseline is not None:
            CONFIGS.update(POOL_ONLY_BASELINE)
    paces = plan(args.quick)
    png = args.png or (Path(tempfile.gettempdir()) / "codex-failover-bench-quick.png" if args.quick
                       else ROOT / "docs" / "bench.png")
    input_text = ("Refactor the parser and keep the tests green. " * (args.body_kib * 1024 // 46 + 1))[:args.body_kib * 1024]
    began = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="codex-failover-bench-") as tmp:
        tmp = Path(tmp)
        for pace in paces:
            (tmp / pace.name).mkdir()
            fake_args = ["--trace", "--pace", str(pace.seconds), "--deltas", str(pace.deltas)]
            if pace.trace_events:
                fake_args.append("--trace-events")
            fake = FakeUpstreamProcess(tmp / pace.name, *fake_args)
            proxies: dict[str, ProxyProcess] = {}
            try:
                text, env = pool_yaml(fake.base, [("spare", SPARE_KEY)], overload_cooldown="1s")
                pool_only, _ = pool_yaml(fake.base, [("spare", SPARE_KEY)], overload_cooldown="1s",
                                         use_client_credential=False)
                for cfg in CONFIGS:
                    d = tmp / pace.name / cfg
                    d.mkdir()
                    if cfg == "a":
                        proxies[cfg] = ProxyProcess(d, None, addon=False, extra=["--set", "stream_large_bodies=1"])
                    else:
                        proxies[cfg] = ProxyProcess(d, pool_only if cfg in (*POOL_ONLY, *POOL_ONLY_BASELINE) else text,
                                                    env, script=args.baseline if cfg in (*BASELINE, *POOL_ONLY_BASELINE)
                                                    else None)
                for cfg, proxy in proxies.items():
                    warm_up(proxy, fake, cfg, input_text)
                log = FakeLog(fake.log_path)
                run = 0
                for c, rounds, blocks in pace.levels:
                    parts: dict[str, list[Result]] = {cfg: [] for cfg in CONFIGS}
                    for _ in range(blocks):  # the configurations take turns, so drift hits them alike
                        for cfg in CONFIGS:
                            run += 1
                            parts[cfg].append(run_once(pace, cfg, proxies[cfg], fake, log, run, c, rounds, input_text))
                    for cfg in CONFIGS:
                        r = merge(parts[cfg])
                        results.append(r)
                        print(f"  {pace.name:<9} C={c:<3} ({cfg}) {r.ok}/{r.streams} streams, {r.events} events, "
                              f"{r.wall_s:.1f} s", file=sys.stderr, flush=True)
            finally:
                for proxy in proxies.values():
                    proxy.stop()
                fake.stop()
    print(f"codex-failover proxy benchmark{' (quick)' if args.quick else ''}: {os.cpu_count()} CPUs, "
          f"mitmproxy 12.3.1, python {sys.version.split()[0]}, {time.monotonic() - began:.0f} s")
    print_tables(results, paces, args.body_kib)
    print()
    print("goals:")
    for ok, text in checks(results, paces):
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")
    chart(results, paces, png)
    print(f"\nchart: {png}")
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "events_per_s": r.events_per_s, "cpu_per_1k": r.cpu_per_1k,
                                          "mb_per_stream": r.mb_per_stream} for r in results], indent=1))
    failed = [(r, e) for r in results for e in r.errors]
    for r, e in failed[:10]:
        print(f"error: {r.pace} C={r.concurrency} ({r.config}): {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
