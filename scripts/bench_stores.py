"""First-byte latency through the addon with each pool state store, side by side in one run:
memory (keeps nothing), sqlite (the default file) and redis (a local redis-server on loopback).
Run as `scripts/bench --stores [--requests N]`.

The store is off the request path by design (writes batched every 0.2 s and, for Redis, reads every
0.5 s, both in a worker thread), so a store should add nothing a client can feel: the target is
under 1 ms added to the median. Requests take turns across the three proxies so drift hits them alike;
each row gives the median and p95 of the time to the first response byte, and the difference of the
median to `memory`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import FakeUpstreamProcess, ProxyProcess, RedisProcess, pool_yaml, post_responses

STORES = ("memory", "sqlite", "redis")


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def run(requests: int) -> dict[str, list[float]]:
    if shutil.which("redis-server") is None:
        raise SystemExit("bench --stores: redis-server is not installed (scripts/setup-system installs it)")
    with tempfile.TemporaryDirectory(prefix="codex-failover-bench-stores-") as tmp:
        tmp = Path(tmp)
        fake = FakeUpstreamProcess(tmp, "--pace", "0.002", "--deltas", "4")
        redis = RedisProcess()
        proxies: dict[str, ProxyProcess] = {}
        try:
            for store in STORES:
                text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
                spec = {"memory": "memory", "sqlite": "sqlite", "redis": redis.url}[store]
                text += f"state:\n  store: {spec}\n"
                proxies[store] = ProxyProcess(tmp / store, text, env)
            url = f"{fake.base}/v1/responses"
            times: dict[str, list[float]] = {s: [] for s in STORES}
            for i in range(requests + 5):
                for store in STORES:
                    # Alternate a failover (state changes: cooldown, usage, session) and a plain request.
                    key = "sk-test-client-overload" if i % 2 else "sk-test-client-good"
                    try:
                        reply = post_responses(proxies[store].port, url, key, headers={"session-id": f"s{i}"})
                    except OSError as exc:
                        reply = None
                        failure = f"{exc!r}"
                    if reply is None or reply.status != 200:
                        tail = " | ".join(proxies[store].log().strip().splitlines()[-12:])
                        raise SystemExit(f"bench --stores: {store}: "
                                         f"{failure if reply is None else f'HTTP {reply.status}'}; its log ends: {tail}")
                    if i >= 5:  # the first few warm everything up
                        times[store].append(reply.first_byte_s * 1000)
            return times
        finally:
            for proxy in proxies.values():
                proxy.stop()
            redis.stop()
            fake.stop()


def report(times: dict[str, list[float]]) -> str:
    base = statistics.median(times["memory"])
    lines = [f"{'store':<8} {'n':>4} {'median ms':>10} {'p95 ms':>8} {'vs memory':>10}"]
    for store in STORES:
        median = statistics.median(times[store])
        lines.append(f"{store:<8} {len(times[store]):>4} {median:>10.2f} {p95(times[store]):>8.2f} "
                     f"{median - base:>+10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60, help="requests per store (default 60)")
    args = ap.parse_args(argv)
    print(report(run(args.requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
