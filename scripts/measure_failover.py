#!/usr/bin/env python3
"""Measure what failover costs, end to end on 127.0.0.1, side by side in one run.

- rejection -> next attempt: from the fake upstream writing the overload event of the client's
  attempt to the spare's request arriving at the fake;
- first output -> client: from the fake writing the winner's first output event to the client
  having read that event; for the addon with a failover, the addon with a healthy credential,
  plain mitmdump streaming bodies (no addon) and no proxy at all. With the addon this event is
  the one that commits the held stream, so it is also the client's first byte.

Timestamps come from two processes on one machine (wall clock). Prints medians and p95 in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import FakeUpstreamProcess, ProxyProcess, pool_yaml, post_responses


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def traces(fake: FakeUpstreamProcess, since: int) -> list[dict]:
    return fake.requests()[since:]


def first(records: list[dict], **match) -> dict:
    return next(r for r in records if all(r.get(k) == v for k, v in match.items()))


def run_case(fake: FakeUpstreamProcess, port: int | None, token: str, runs: int, failover: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"first_output_to_client_ms": [], "rejection_to_next_attempt_ms": []}
    url = f"{fake.base}/v1/responses"
    for i in range(runs):
        since = len(fake.requests())
        if port is None:  # no proxy: the client talks to the fake directly
            reply = post_responses_direct(fake, token)
        else:
            reply = post_responses(port, url, f"{token}-{i}" if failover else token)
        assert reply.status == 200, reply.body[:200]
        recs = traces(fake, since)
        winner = first(recs, event="first_output_sent")
        seen = reply.first_seen_at(b'"type":"response.reasoning_summary_text.delta"')
        out["first_output_to_client_ms"].append((seen - winner["ts"]) * 1000)
        if failover:
            rejected = first(recs, event="rejection_sent")
            spare_req = next(r for r in recs if r.get("scenario") == "good" and r["ts"] >= rejected["ts"])
            out["rejection_to_next_attempt_ms"].append((spare_req["ts"] - rejected["ts"]) * 1000)
    return out


def post_responses_direct(fake: FakeUpstreamProcess, token: str):
    import http.client
    import json
    import time

    from harness import Reply

    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=30)
    started, started_at = time.monotonic(), time.time()
    conn.request("POST", "/v1/responses", body=json.dumps({"stream": True, "input": []}),
                 headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    resp = conn.getresponse()
    reply = Reply(resp.status, dict(resp.getheaders()), b"", started_at=started_at)
    data = bytearray()
    while chunk := resp.read1(65536):
        reply.chunks.append((time.monotonic() - started, chunk))
        data += chunk
    reply.body = bytes(data)
    conn.close()
    return reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fake = FakeUpstreamProcess(tmp, "--trace", "--pace", "0.01", "--deltas", "10")
        procs = []
        try:
            (tmp / "a").mkdir(), (tmp / "b").mkdir()
            text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")], overload_cooldown="1s")
            addon = ProxyProcess(tmp / "a", text, env)
            plain = ProxyProcess(tmp / "b", None, addon=False, extra=["--set", "stream_large_bodies=1"])
            procs += [addon, plain]
            cases = [
                ("addon, own credential overloaded", addon.port, "sk-test-client-overload", True),
                ("addon, healthy credential", addon.port, "sk-test-client-good", False),
                ("plain mitmdump, streaming", plain.port, "sk-test-client-good", False),
                ("no proxy", None, "sk-test-client-good", False),
            ]
            print(f"{args.runs} runs per case; fake upstream paces events 10 ms apart; times in ms (median / p95)")
            print(f"{'case':<36} {'first output -> client':>28} {'rejection -> next attempt':>27}")
            for name, port, token, failover in cases:
                res = run_case(fake, port, token, args.runs, failover)
                a = res["first_output_to_client_ms"]
                b = res["rejection_to_next_attempt_ms"]
                col_b = f"{statistics.median(b):8.2f} / {pct(b, 0.95):7.2f}" if b else f"{'-':>18}"
                print(f"{name:<36} {statistics.median(a):10.2f} / {pct(a, 0.95):7.2f}{'':>8} {col_b:>27}")
        finally:
            for p in procs:
                p.stop()
            fake.stop()


if __name__ == "__main__":
    main()
