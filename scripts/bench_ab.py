"""An A/B of CPU per request that resolves a few hundredths of a millisecond: checkouts of the addon
against each other and plain mitmdump, each configuration run as `--instances` mitmdump processes.
Run as `scripts/bench --ab OTHER/addon/failover.py [MORE/addon/failover.py ...] [--length short] [--pool-only]`
(`--pool-only`: every checkout in pool-only mode, `use_client_credential: false`: every attempt over the
addon's kept upstream connections, none on the client's own stream).

Why a tool of its own: `scripts/bench --cost` runs one process per configuration, and one process's
own layout (where its objects and code landed, its hash seed) moves its CPU per request by 0.03-0.05 ms
against another process of the same checkout; with three processes each the medians of two copies of
one checkout came 0.009-0.012 ms apart (docs/measurements.md). Every proxy's threads run on the last CPU,
the client and the fake on the others (when the host has two); turns of `--block` requests (25: the
caches as other programs leave them) go round every process in a shuffled order; a configuration's
figure is the median of its turns' CPU per request (each thread's time on a CPU, in ns, from
/proc/PID/task/*/schedstat), its ratio is to plain mitmdump's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ProcStats  # noqa: E402
from bench_cost import LENGTHS, checkout_label, pin, pool_text, requests  # noqa: E402
from harness import FakeUpstreamProcess, ProxyProcess, stop_leftovers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOADED = "codex-failover: pool"  # the addon's start-up line: the checkout loaded as the addon


def not_an_addon(path: Path) -> str | None:
    """Why `path` is not a checkout's addon/failover.py (None: it is)."""
    if not path.is_file():
        return f"no such file: {path}"
    if path.name != "failover.py" or not (path.parent / "codex_failover").is_dir():
        return f"not a checkout's addon/failover.py (no codex_failover/ beside it): {path}"
    return None


def start(procs: list, label: str, folder: Path, *args, **kwargs) -> None:
    """A proxy started and kept for the end; one that does not start, or is no addon (it never logs
    its pool), stops the run with its log's last line."""
    try:
        proxy = ProxyProcess(folder, *args, **kwargs)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"bench --ab: {label} did not start ({exc}): {_last_line(folder / 'mitmdump.log')}") from None
    procs.append((label, proxy))
    deadline = time.monotonic() + 5
    while label != "plain" and LOADED not in proxy.log():
        if proxy.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench --ab: {label} did not load as the addon: {_last_line(proxy.log_path)}")
        time.sleep(0.05)


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "(no output)"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench --ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkouts", nargs="+", type=Path, help="addon/failover.py of each checkout to compare")
    ap.add_argument("--requests", type=int, default=6000,
                    help="measured requests per configuration (at least: whole turns of every process)")
    ap.add_argument("--instances", type=int, default=3, help="mitmdump processes per configuration")
    ap.add_argument("--block", type=int, default=25, help="requests in one process's turn")
    ap.add_argument("--length", choices=sorted(LENGTHS), default="short", help="the streams' length")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--pool-only", action="store_true",
                    help="every checkout in pool-only mode (use_client_credential: false)")
    args = ap.parse_args(argv)
    for path in args.checkouts:
        if (why := not_an_addon(path)) is not None:
            print(f"bench --ab: {why}", file=sys.stderr)
            return 2
    if len({p.resolve() for p in args.checkouts}) < len(args.checkouts):
        print("bench --ab: a checkout is named twice", file=sys.stderr)
        return 2
    if args.requests < 1 or args.instances < 1 or args.block < 1:
        print("bench --ab: --requests, --instances and --block must be positive", file=sys.stderr)
        return 2
    try:
        return run(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    finally:
        stop_leftovers()  # every process started, by its PID, whatever stopped the run


def run(args: argparse.Namespace) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpu, others = (cpus[-1], set(cpus[:-1])) if len(cpus) >= 2 else (None, set(cpus))
    os.sched_setaffinity(0, others)
    labels = [f"{checkout_label(p)} ({p.resolve().parents[1]})" for p in args.checkouts]
    turns = -(-args.requests // (args.block * args.instances))  # at least --requests per configuration
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp_name:
        tmp = Path(tmp_name)
        procs: list[tuple[str, ProxyProcess]] = []
        fake = None
        try:
            fake = FakeUpstreamProcess(tmp / "fake", "--pace", "0", "--deltas", str(LENGTHS[args.length]))
            os.sched_setaffinity(fake.proc.pid, others)
            text, env = pool_text({args.length: fake}, pool_only=args.pool_only)
            for k in range(args.instances):
                start(procs, "plain", tmp / f"plain-{k}", None, addon=False, extra=["--set", "stream_large_bodies=1"])
                for i, (label, path) in enumerate(zip(labels, args.checkouts, strict=True)):
                    start(procs, label, tmp / f"c{i}-{k}", text, env, addon=False, extra=["-s", str(path.resolve())])
            if proxy_cpu is not None:
                for _, proxy in procs:
                    pin(proxy.proc.pid, proxy_cpu)
            for _, proxy in procs:
                asyncio.run(requests(proxy.port, fake.port, "warm", 40))
            per: dict[str, list[float]] = {label: [] for label, _ in procs}
            stats = [ProcStats(proxy.proc.pid) for _, proxy in procs]
            for turn in range(turns):
                order = list(range(len(procs)))
                random.Random(turn).shuffle(order)
                for j in order:
                    label, proxy = procs[j]
                    before = stats[j].run_time()
                    asyncio.run(requests(proxy.port, fake.port, f"t{turn}", args.block))
                    per[label].append((stats[j].run_time() - before) / args.block * 1000)
        finally:
            for _, proxy in procs:
                try:
                    proxy.stop()
                except OSError:
                    pass  # (stop_leftovers tries again)
            if fake is not None:
                fake.stop()
    where = f"proxies on CPU {proxy_cpu}" if proxy_cpu is not None else "proxies unpinned (one CPU)"
    mode = ", pool-only mode" if args.pool_only else ""
    print(f"{args.length} streams{mode}, {args.instances} processes per configuration, turns of {args.block} requests, {where}")
    print(f"{'configuration':48} {'median ms':>9}  {'p10..p90':>13}  ratio   turns")
    base = statistics.median(per["plain"])
    figures = {}
    for label, values in per.items():
        values = sorted(values)
        median = statistics.median(values)
        p10, p90 = values[len(values) // 10], values[-1 - len(values) // 10]
        figures[label] = {"median": median, "p10": p10, "p90": p90, "ratio": median / base, "turns": len(values)}
        print(f"{label:48} {median:9.3f}  {p10:6.3f}..{p90:6.3f}  {median / base:5.3f}x  {len(values)}")
    if args.json:
        args.json.write_text(json.dumps({"length": args.length, "instances": args.instances, "block": args.block,
                                         "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
