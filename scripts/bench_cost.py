"""What a proxy left on costs: CPU per request and memory through plain mitmdump and the addon, side by
side in one run, fresh and after N sessions, and idle CPU afterwards. Run as
`scripts/bench --cost [--sessions N] [--baseline /other/checkout/addon/failover.py]`.

Configurations, each its own mitmdump process, all against the same fake upstreams on 127.0.0.1:
  plain     mitmdump without -s (bodies streamed: --set stream_large_bodies=1, as the addon streams)
  script    plain with an empty `-s` script (mitmproxy checks a script for changes once a second):
            what "idle like plain mitmdump with a script" is measured against
  addon     mitmdump -s addon/failover.py (this checkout), a pool of two spares, the default SQLite store
  base-<commit>  (each --baseline) the same with another checkout's addon/failover.py: an A/B in one run
  ... pool-only  (with --pool-only) each addon configuration again in pool-only mode (`use_client_credential:
            false`): every attempt on a pooled spare over the addon's kept upstream connections, a second
            flow each, none on the client's own stream

Every request is a Codex-like streamed POST .../responses (absolute-form http:// URL) on a kept-alive
client connection, with its own `session-id` (a day of Codex sessions), answered healthy by the
client's own credential: short streams (13 events) and long ones (48 events), from two fakes.
Requests take turns across the configurations in blocks (`--block`, 25), so drift and neighbours hit
them alike; each proxy meets the CPU's caches as the others left them, as a proxy left on meets them
after the machine's other programs (larger blocks give warmer caches: short streams then cost the
addon 0.2-0.3 ms less, plain mitmdump the same; docs/measurements.md). `--pin` runs every proxy's
threads on the last CPU and the clients and fakes on the others (a host of 2 CPUs or more).

Phases: fresh (`--requests` of each length per configuration), then each proxy is given
`--sessions` more requests (new sessions, short streams, 4 connections), then the same measured
requests again ("after N"), then `--idle` seconds with no traffic. Reported per configuration:
CPU per request in ms (the time on a CPU of the mitmdump process's threads, from
/proc/PID/task/*/schedstat, over the phase, divided by its requests) and its ratio to plain
mitmdump's; idle CPU in ms per second and wake-ups per second
(context switches of all the process's threads, from /proc/PID/task/*/status); RSS (MiB) fresh,
after N, after idle; the state file's size; the host's load average and how busy its CPUs were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ProcStats  # noqa: E402
from harness import FakeUpstreamProcess, ProxyProcess  # noqa: E402

LENGTHS = {"short": 2, "long": 31}  # fake --deltas: 2 + 1 + 10 = 13 events, 31 + 7 + 10 = 48 events
BLOCK = 25  # requests per turn of one configuration
TIMEOUT = 30.0  # seconds one request may take at most


class Conn:
    """One kept-alive HTTP/1.1 client connection to a proxy: POST, read the whole streamed answer."""

    def __init__(self, port: int):
        self.port, self.reader, self.writer = port, None, None

    async def post(self, fake_port: int, token: str, session: str) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 10)
        body = json.dumps({"model": "gpt-fake", "stream": True, "store": False, "instructions": "Be brief.",
                           "input": [{"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "Say hello."}]}],
                           "prompt_cache_key": session}).encode()
        head = (f"POST http://127.0.0.1:{fake_port}/v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{fake_port}\r\n"
                f"authorization: Bearer {token}\r\ncontent-type: application/json\r\naccept: text/event-stream\r\n"
                f"session-id: {session}\r\ncontent-length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode() + body)
        await asyncio.wait_for(self._answer(), TIMEOUT)

    async def _answer(self) -> None:
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"answer: {head[:80]!r}")
        if b"transfer-encoding: chunked" in head:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    return
        length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.startswith(b"content-length:")), None)
        if length is None:
            raise RuntimeError("an answer neither chunked nor of known length (not kept alive)")
        await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def requests(port: int, fake_port: int, tag: str, count: int, connections: int = 1) -> None:
    """`count` requests, each a new session, over `connections` kept-alive connections."""
    conns = [Conn(port) for _ in range(connections)]
    todo = iter(range(count))

    async def worker(conn: Conn) -> None:
        for i in todo:
            await conn.post(fake_port, f"sk-test-cost-good-{tag}", f"cost-{tag}-{i}")
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            c.close()


def checkout_label(failover_py: Path) -> str:
    """The commit a checkout's addon/failover.py is at (its folder's name when it is no git checkout)."""
    import subprocess

    root = failover_py.resolve().parents[1]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return root.name


def wakeups(pid: int) -> int:
    """Context switches of every thread of `pid` so far (each one a wake-up, or a preemption)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue  # a thread that just ended
        total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches:" in line)
    return total


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` on `cpu` (threads it starts later inherit it from their creator)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (OSError, ValueError):
            continue  # a thread that just ended


def load_average() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def pool_text(fakes: dict[str, FakeUpstreamProcess], pool_only: bool = False) -> tuple[str, dict[str, str]]:
    """A pool of one spare per fake; `pool_only`: `use_client_credential: false` (pool-only mode)."""
    lines, env = ["credentials:"], {}
    for name, fake in fakes.items():
        env[f"KEY_{name.upper()}"] = f"sk-test-spare-{name}"
        lines += [f"  - name: spare-{name}", f"    api_key_env: KEY_{name.upper()}", f"    base_url: {fake.base}/v1"]
    if pool_only:
        lines += ["policy:", "  use_client_credential: false"]
    return "\n".join(lines) + "\n", env


def measure(proxies: dict[str, ProxyProcess], fakes: dict[str, FakeUpstreamProcess], phase: str, count: int,
            out: dict, block_size: int = BLOCK) -> None:
    """CPU per request of each configuration and length, in turns of `block_size` requests."""
    stats = {cfg: ProcStats(p.proc.pid) for cfg, p in proxies.items()}
    for length, fake in fakes.items():
        cpu = {cfg: 0.0 for cfg in proxies}
        for block in range(0, count, block_size):
            n = min(block_size, count - block)
            for cfg, proxy in proxies.items():
                c0 = stats[cfg].run_time()
                asyncio.run(requests(proxy.port, fake.port, f"{phase}-{length}-{block}", n))
                cpu[cfg] += stats[cfg].run_time() - c0
        for cfg in proxies:
            out.setdefault(cfg, {})[f"{phase} {length}"] = cpu[cfg] / count * 1000
    for cfg in proxies:
        out[cfg][f"rss {phase}"] = stats[cfg].mem()["VmRSS"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench --cost", description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=10_000, help="sessions each proxy is given between the phases")
    ap.add_argument("--requests", type=int, default=200, help="measured requests per length, configuration and phase")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measured at the end")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="another checkout's addon/failover.py, measured alongside (may be given more than once)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--block", type=int, default=BLOCK, help="requests in one configuration's turn")
    ap.add_argument("--pin", action="store_true", help="the proxies on the last CPU, the clients on the others")
    ap.add_argument("--pool-only", action="store_true",
                    help="each addon configuration also in pool-only mode (use_client_credential: false): every "
                         "attempt over the kept upstream connections")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    proxy_cpu = cpus[-1] if len(cpus) >= 2 and args.pin else None
    if proxy_cpu is not None:  # this process (the clients) and the fakes it starts: the other CPUs
        os.sched_setaffinity(0, set(cpus[:-1]))
    began = time.monotonic()
    out: dict[str, dict] = {}
    host0 = ProcStats.host_jiffies()
    loads = [load_average()]
    with tempfile.TemporaryDirectory(prefix="codex-failover-bench-cost-") as tmp:
        tmp = Path(tmp)
        fakes = {name: FakeUpstreamProcess(tmp / f"fake-{name}", "--pace", "0", "--deltas", str(deltas))
                 for name, deltas in LENGTHS.items()}
        proxies: dict[str, ProxyProcess] = {}
        try:
            text, env = pool_text(fakes)
            pool_only, _ = pool_text(fakes, pool_only=True)
            proxies["plain"] = ProxyProcess(tmp / "plain", None, addon=False, extra=["--set", "stream_large_bodies=1"])
            (tmp / "empty.py").write_text("addons = []\n")
            proxies["script"] = ProxyProcess(tmp / "script", None, addon=False,
                                             extra=["--set", "stream_large_bodies=1", "-s", str(tmp / "empty.py")])
            proxies["addon"] = ProxyProcess(tmp / "addon", text, env)
            if args.pool_only:
                proxies["pool-only"] = ProxyProcess(tmp / "pool-only", pool_only, env)
            for path in args.baseline:
                name = f"base-{checkout_label(path)}"
                proxies[name] = ProxyProcess(tmp / name, text, env, addon=False, extra=["-s", str(path.resolve())])
                if args.pool_only:
                    proxies[f"{name} pool-only"] = ProxyProcess(tmp / f"{name}-pool-only", pool_only, env, addon=False,
                                                                extra=["-s", str(path.resolve())])
            if proxy_cpu is not None:
                for proxy in proxies.values():
                    pin(proxy.proc.pid, proxy_cpu)
            for proxy in proxies.values():  # warm up: imports, first connections
                for fake in fakes.values():
                    asyncio.run(requests(proxy.port, fake.port, "warm", 5))
            measure(proxies, fakes, "fresh", args.requests, out, args.block)
            loads.append(load_average())
            for block in range(0, args.sessions, 500):  # the sessions, in turns too
                n = min(500, args.sessions - block)
                for proxy in proxies.values():
                    asyncio.run(requests(proxy.port, fakes["short"].port, f"fill-{block}", n, connections=4))
                print(f"  {block + n} sessions given to each proxy ({time.monotonic() - began:.0f} s)",
                      file=sys.stderr, flush=True)
            time.sleep(1.0)  # the keepers' last writes
            phase = f"after {args.sessions}"
            measure(proxies, fakes, phase, args.requests, out, args.block)
            loads.append(load_average())
            time.sleep(1.0)
            stats = {cfg: ProcStats(p.proc.pid) for cfg, p in proxies.items()}
            c0 = {cfg: s.cpu() for cfg, s in stats.items()}
            w0 = {cfg: wakeups(p.proc.pid) for cfg, p in proxies.items()}
            t0 = time.monotonic()
            time.sleep(args.idle)
            took = time.monotonic() - t0
            for cfg, s in stats.items():
                out[cfg]["idle ms/s"] = (s.cpu() - c0[cfg]) / took * 1000
                out[cfg]["idle wakeups/s"] = (wakeups(proxies[cfg].proc.pid) - w0[cfg]) / took
                out[cfg]["rss idle"] = s.mem()["VmRSS"]
            for cfg in proxies:
                folder = tmp / cfg / "state" / "codex-failover"  # the file and its WAL
                out[cfg]["state file KiB"] = sum(f.stat().st_size for f in folder.glob("state.sqlite*")) / 1024 \
                    if folder.exists() else 0.0
        finally:
            for proxy in proxies.values():
                proxy.stop()
            for fake in fakes.values():
                fake.stop()
    host1 = ProcStats.host_jiffies()
    busy = (host1[0] - host0[0]) / max(1, host1[1] - host0[1])
    where = f"proxies on CPU {proxy_cpu}, clients on the others" if proxy_cpu is not None else "not pinned"
    where += f", turns of {args.block} requests"
    print(f"codex-failover cost benchmark: {os.cpu_count()} CPUs ({where}), load average {' -> '.join(loads)}, "
          f"host busy {busy:.0%}, {time.monotonic() - began:.0f} s")
    phases = ["fresh", f"after {args.sessions}"]
    print(f"\nCPU per request, ms (ratio to plain mitmdump); {args.requests} requests per cell, each a new session")
    print(f"{'':<24}" + "".join(f"{p + ' ' + length:>22}" for p in phases for length in LENGTHS))
    for cfg in proxies:
        cells = []
        for p in phases:
            for length in LENGTHS:
                v, base = out[cfg][f"{p} {length}"], out["plain"][f"{p} {length}"]
                cells.append(f"{v:8.2f} ({v / base:4.2f}x)")
        print(f"{cfg:<24}" + "".join(f"{c:>22}" for c in cells))
    print(f"\n{'':<24}{'idle CPU ms/s':>15}{'wakeups/s':>11}{'RSS fresh':>11}{'RSS after':>11}{'RSS idle':>10}{'state KiB':>11}")
    for cfg in proxies:
        o = out[cfg]
        print(f"{cfg:<24}{o['idle ms/s']:>15.2f}{o['idle wakeups/s']:>11.1f}{o['rss fresh']:>11.0f}{o[f'rss after {args.sessions}']:>11.0f}"
              f"{o['rss idle']:>10.0f}{o['state file KiB']:>11.0f}")
    if args.json:
        args.json.write_text(json.dumps({"load": loads, "host_busy": busy, "figures": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
