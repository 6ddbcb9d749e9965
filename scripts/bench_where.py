"""Where the addon's CPU per request goes, against plain mitmdump: both proxies sample their own CPU
time (scripts/where_sampler.py: SIGPROF, every Python function on the stack counted) over the same
kept-alive Codex-like requests, and each function's inclusive share is turned into ms a request
(the process's CPU from /proc/PID/task/*/schedstat, split by samples). Printed: the functions with the
largest difference (the addon's extra work, and what it moved), then the largest differences of self
time (where that work is done). Run as `scripts/bench --where [--requests 4000] [--top 40] [--pool-only]`.

A sample is taken at a kernel tick of the process's CPU time (4 ms at HZ=250), so a few thousand
requests give a few thousand samples: read the larger rows, not the last digit. The proxies run on the
last CPU, the clients and the fake on the others (as `--ab`); nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ProcStats  # noqa: E402
from bench_cost import LENGTHS, pin, pool_text, requests  # noqa: E402
from harness import FakeUpstreamProcess, ProxyProcess  # noqa: E402

SAMPLER = Path(__file__).resolve().parent / "where_sampler.py"
WARM_UP = 300


def read(path: Path) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """(samples, responses, inclusive counts, self counts) a sampler wrote."""
    lines = path.read_text().splitlines()
    head = lines[0].split()
    inclusive: dict[str, int] = {}
    running: dict[str, int] = {}
    for line in lines[1:]:
        kind, n, name = line.split(" ", 2)
        (inclusive if kind == "I" else running)[name] = int(n)
    return int(head[1]), int(head[3]), inclusive, running


def table(title: str, plain: dict[str, float], addon: dict[str, float], top: int) -> list[str]:
    names = sorted(set(plain) | set(addon), key=lambda n: -(addon.get(n, 0.0) - plain.get(n, 0.0)))
    rows = [title, f"{'addon':>8} {'plain':>8} {'extra':>8}  ms a request"]
    rows += [f"{addon.get(n, 0.0):8.3f} {plain.get(n, 0.0):8.3f} {addon.get(n, 0.0) - plain.get(n, 0.0):+8.3f}  {n}"
             for n in names[:top]]
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench --where", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000, help="measured requests per proxy (after 300 to warm up)")
    ap.add_argument("--length", choices=sorted(LENGTHS), default="short", help="the streams' length")
    ap.add_argument("--top", type=int, default=40, help="rows of each table")
    ap.add_argument("--warm-up", type=int, default=WARM_UP, help="requests each proxy serves before sampling starts")
    ap.add_argument("--pool-only", action="store_true",
                    help="the addon in pool-only mode (use_client_credential: false): every attempt a second flow")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="codex-failover-where-") as tmp_dir:
        tmp = Path(tmp_dir)
        fake = FakeUpstreamProcess(tmp / "fake", "--deltas", str(LENGTHS[args.length]), "--pace", "0")
        text, env = pool_text({args.length: fake}, pool_only=args.pool_only)
        sampled = ["-s", str(SAMPLER)]
        flows = {"plain": 1, "addon": 2 if args.pool_only else 1}  # flows a request (each ends in a `response` hook)
        proxies = {
            "plain": ProxyProcess(tmp / "plain", None, {"WHERE_OUT": str(tmp / "plain.txt"), "WHERE_SKIP": str(args.warm_up)},
                                  addon=False, extra=["--set", "stream_large_bodies=1", *sampled]),
            "addon": ProxyProcess(tmp / "addon", text, {**env, "WHERE_OUT": str(tmp / "addon.txt"),
                                                        "WHERE_SKIP": str(args.warm_up * flows["addon"])}, extra=sampled),
        }
        try:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) > 1:
                for proxy in proxies.values():
                    pin(proxy.proc.pid, cpus[-1])
                os.sched_setaffinity(0, set(cpus[:-1]))
            per_request: dict[str, float] = {}
            for name, proxy in proxies.items():
                asyncio.run(requests(proxy.port, fake.port, f"{name}-warm", args.warm_up))
                stats = ProcStats(proxy.proc.pid)
                before = stats.run_time()
                asyncio.run(requests(proxy.port, fake.port, name, args.requests))
                per_request[name] = (stats.run_time() - before) / args.requests * 1000
        finally:
            for proxy in proxies.values():
                proxy.stop()
            fake.stop()
        inclusive, running = {}, {}
        for name in proxies:
            samples, seen, inc, run = read(tmp / f"{name}.txt")
            if seen != args.requests * flows[name]:
                raise SystemExit(f"bench --where: {name} sampled {seen} responses, not {args.requests * flows[name]}")
            scale = per_request[name] / max(1, samples)  # ms a request per sample
            inclusive[name] = {k: v * scale for k, v in inc.items()}
            running[name] = {k: v * scale for k, v in run.items()}
    print(f"CPU a request: plain {per_request['plain']:.3f} ms, addon {per_request['addon']:.3f} ms "
          f"({per_request['addon'] / per_request['plain']:.3f}x); {args.requests} {args.length} streams each"
          f"{', the addon in pool-only mode' if args.pool_only else ''}")
    print("\n".join(table("\nInclusive (the function and what it calls):", inclusive["plain"], inclusive["addon"], args.top)))
    print("\n".join(table("\nSelf (the function itself):", running["plain"], running["addon"], args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
