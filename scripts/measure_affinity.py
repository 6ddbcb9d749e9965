#!/usr/bin/env python3
"""How well sessions keep their credential (and so their prompt cache), end to end on 127.0.0.1.

20 sessions x 10 turns, interleaved, through the proxy to the fake upstream; the pool has three
healthy API-key credentials selected round-robin; once, in the middle (before turn 6), the next
request of credential `a` is overloaded. Counts the turns served by another credential than the
session's previous turn, with affinity on (the default) and off (`session_idle: 0`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import FakeUpstreamProcess, ProxyProcess, pool_yaml, post_responses

SPARES = [("a", "sk-test-a-good"), ("b", "sk-test-b-good"), ("c", "sk-test-c-good")]


def run(tmp: Path, sessions: int, turns: int, session_idle: str) -> dict:
    fake = FakeUpstreamProcess(tmp, "--pace", "0", "--deltas", "3")
    text, env = pool_yaml(fake.base, SPARES, use_client_credential=False, selection="round-robin",
                          session_idle=session_idle)
    proxy = ProxyProcess(tmp, text, env)
    served: dict[str, list[str]] = {}
    try:
        for turn in range(1, turns + 1):
            if turn == turns // 2 + 1:
                fake.overload_next("sk-test-a-good")
            for s in range(sessions):
                reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good",
                                       headers={"session-id": f"session-{s}"})
                assert reply.status == 200
                who = reply.body.decode().split("Hello from ", 1)[1].split(".", 1)[0]
                served.setdefault(f"session-{s}", []).append(who)
    finally:
        proxy.stop()
        fake.stop()
    changes = sum(1 for seq in served.values() for prev, cur in zip(seq, seq[1:], strict=False) if prev != cur)
    failovers = sum(1 for r in fake.model_requests() if r["scenario"] == "overload")
    on_a = sum(1 for seq in served.values() if seq[turns // 2 - 1] == "sk-test-a-good")
    return {"turns": sessions * turns, "changes": changes, "failovers": failovers, "on_a": on_a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--turns", type=int, default=10)
    args = ap.parse_args()
    print(f"{args.sessions} sessions x {args.turns} turns, 3 credentials round-robin, one overload before turn "
          f"{args.turns // 2 + 1}")
    print(f"{'affinity':<10} {'turns':>6} {'credential changes':>19} {'overloads seen':>15} {'sessions on a before':>21}")
    for label, idle in (("on", "1h"), ("off", "0")):
        with tempfile.TemporaryDirectory() as tmp:
            res = run(Path(tmp), args.sessions, args.turns, idle)
        print(f"{label:<10} {res['turns']:>6} {res['changes']:>19} {res['failovers']:>15} {res['on_a']:>21}")
    print("With affinity, the sessions that move are those homed on `a`: one by the failover itself, the others\n"
          "because `a` is cooling (overload_cooldown) when their next turn comes; none moves back or again.")


if __name__ == "__main__":
    main()
