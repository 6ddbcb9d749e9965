#!/usr/bin/env python3
"""Measure what `failover_websocket: gate` costs on Codex's Responses WebSocket, on 127.0.0.1, side by side in one run.

1. Per turn, R turns on one socket: from the client sending `response.create` to its first output message
   (`response.reasoning_summary_text.delta` / `response.output_text.delta`) and to `response.completed`, for
   (a) no proxy, (b) mitmdump + addon with `failover_websocket=passthrough` (mitmproxy relays the socket),
   (c) mitmdump + addon with `failover_websocket=gate` and a healthy credential. Also "first output written by
   the fake -> read by the client": the fake's `--trace` record (wall clock, after its write) against the
   client's wall clock when it had the whole message.
2. Failover, a new gated socket per run: create -> first output when the first turn is rejected (the fake is
   told to overload the credential that got the handshake) and moves to the spare, against the same with a
   healthy credential; and, from the fake's records, rejection written -> the spare's handshake / turn arriving.
3. Throughput: one `many` turn (--burst text deltas written in one burst, no pacing): messages received by the
   client per second, from its create to `response.completed`; no proxy, passthrough, gate.

Timestamps from two processes on one machine compare wall clocks. Prints medians and p95 in ms, and ratios.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import FakeUpstreamProcess, ProxyProcess, WsClient, WsRejected, pool_yaml, proxy_status

CREATE = {"type": "response.create", "model": "gpt-fake", "stream": True, "store": False,
          "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
OUTPUT = ("response.reasoning_summary_text.delta", "response.output_text.delta")
CLIENT_TOKEN = "sk-test-client-good"  # what passthrough forwards; the gate uses its pool's credential
PRIMARY, SPARE = "sk-test-primary-good-1", "sk-test-spare-good-2"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def cell(values: list[float], width: int = 20) -> str:
    text = f"{statistics.median(values):8.2f} / {pct(values, 0.95):7.2f}" if values else "-"
    return f"{text:>{width}}"


def ratio(a: list[float], b: list[float], width: int = 20) -> str:
    text = f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b and statistics.median(b) else "-"
    return f"{text:>{width}}"


def connect(port: int | None, fake: FakeUpstreamProcess, token: str, session: str) -> WsClient:
    headers = {"authorization": f"Bearer {token}", "openai-beta": "responses_websockets=2026-02-06", "session-id": session}
    client = WsClient.connect(port, f"{fake.base}/v1/responses", headers)
    if isinstance(client, WsRejected):
        raise RuntimeError(f"upgrade answered {client.status}: {client.body[:200]!r}")
    return client


def timed_turn(client: WsClient, timeout: float = 30.0) -> dict:
    """Send a create; read the turn (checking its sequence numbers run 0, 1, 2, …). Returns the create's wall
    clock, seconds to the first output and to completed, the first output's wall clock and the number of messages."""
    sent_at, start = time.time(), time.monotonic()
    client.send_json(CREATE)
    out = {"sent_at": sent_at, "first_s": None, "first_at": None, "messages": 0}
    deadline = start + timeout
    while True:
        got = client.recv(max(0.0, deadline - time.monotonic()))
        if got[0] == "close":
            raise RuntimeError(f"the socket closed during a turn: {got}")
        if got[0] != "text":
            continue
        now = time.monotonic()
        out["messages"] += 1
        msg = json.loads(got[1])
        kind, seq = msg.get("type"), msg.get("sequence_number")
        if seq is not None and seq != out["messages"] - 1:  # one clean turn, in order, nothing lost or doubled
            raise RuntimeError(f"message {out['messages']} of the turn has sequence_number {seq}")
        if out["first_s"] is None and kind in OUTPUT:
            out["first_s"], out["first_at"] = now - start, sent_at + (now - start)
        if kind in ("response.completed", "response.failed", "response.incomplete", "error"):
            if kind != "response.completed":
                raise RuntimeError(f"the turn ended with {got[1][:300]}")
            out["done_s"] = now - start
            return out


def records(fake: FakeUpstreamProcess, since: int) -> list[dict]:
    return fake.requests()[since:]


def first(recs: list[dict], **match) -> dict | None:
    return next((r for r in recs if all(r.get(k) == v for k, v in match.items())), None)


def per_turn(fake: FakeUpstreamProcess, port: int | None, runs: int) -> dict[str, list[float]]:
    """R turns on one socket: create -> first output / completed; fake's first output -> client."""
    res = {"first": [], "done": [], "wire": []}
    client = connect(port, fake, CLIENT_TOKEN, f"turns-{port}")
    try:
        for _ in range(runs):
            since = len(fake.requests())
            t = timed_turn(client)
            res["first"].append(t["first_s"] * 1000)
            res["done"].append(t["done_s"] * 1000)
            wrote = first(records(fake, since), event="first_output_sent")
            if wrote:
                res["wire"].append((t["first_at"] - wrote["ts"]) * 1000)
    finally:
        client.close()
    return res


def first_turns(fake: FakeUpstreamProcess, port: int, runs: int, overload: bool) -> dict[str, list[float]]:
    """A new gated socket per run; with `overload`, the credential that got the handshake rejects the turn."""
    res = {"first": [], "to_handshake": [], "to_turn": []}
    for i in range(runs):
        wait_all_ready(port)
        since = len(fake.requests())
        client = connect(port, fake, CLIENT_TOKEN, f"first-{overload}-{i}-{time.time_ns()}")
        try:
            if overload:
                shook = [r for r in records(fake, since) if r.get("websocket")][-1]
                fake.overload_next(shook["credential"], 1, "overload")
            res["first"].append(timed_turn(client)["first_s"] * 1000)
        finally:
            client.close()
        if overload:
            move_times(records(fake, since), res)
    return res


def wait_all_ready(port: int, timeout: float = 10.0) -> None:
    """Until no credential cools (an overload cools its credential for at least 1 s, whatever the policy)."""
    deadline = time.monotonic() + timeout
    while any(c["state"] != "ready" for c in proxy_status(port)["credentials"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"credentials still not ready after {timeout}s: {proxy_status(port)['credentials']}")
        time.sleep(0.05)


def move_times(recs: list[dict], res: dict[str, list[float]]) -> None:
    """Rejection written -> the spare's handshake / turn arriving at the fake (ms), when the fake traced it."""
    rejected = first(recs, event="rejection_sent")
    if rejected is None:
        return
    after = [r for r in recs if r["ts"] >= rejected["ts"] and r.get("credential") != rejected["credential"]]
    handshake = next((r for r in after if r.get("websocket")), None)
    turn = next((r for r in after if r.get("event") == "ws_turn"), None)
    if handshake:
        res["to_handshake"].append((handshake["ts"] - rejected["ts"]) * 1000)
    if turn:
        res["to_turn"].append((turn["ts"] - rejected["ts"]) * 1000)


def throughput(fake: FakeUpstreamProcess, port: int | None, token: str, turns: int) -> list[float]:
    """Messages per second the client received in `many` turns (create -> completed), one socket."""
    client = connect(port, fake, token, f"burst-{port}")
    try:
        rates = []
        for _ in range(turns):
            t = timed_turn(client, timeout=120.0)
            rates.append(t["messages"] / t["done_s"])
        return rates
    finally:
        client.close()


RELAY = {"CODEX_FAILOVER_FALLBACK": "hop"}  # the client's side through the loopback relay, not in process


def gate_proxy(tmp: Path, fake: FakeUpstreamProcess, creds: list[tuple[str, str]], env_extra=None) -> ProxyProcess:
    tmp.mkdir()
    text, env = pool_yaml(fake.base, creds, use_client_credential=False, overload_cooldown="0s")
    return ProxyProcess(tmp, text, {**env, **(env_extra or {})}, extra=["--set", "failover_websocket=gate"])


def report_latency(runs: int, cases: dict[str, dict]) -> None:
    print(f"\n1. per turn: {runs} turns on one socket (ms, median / p95)")
    print(f"{'case':<32} {'create -> first output':>22} {'create -> completed':>22} {'fake wrote 1st output -> client':>32}")
    for name, r in cases.items():
        print(f"{name:<32} {cell(r['first'], 22)} {cell(r['done'], 22)} {cell(r['wire'], 32)}")
    gate, base = cases["(c) gate, healthy credential"], cases["(b) passthrough"]
    print(f"{'    gate / passthrough (medians)':<32} {ratio(gate['first'], base['first'], 22)} "
          f"{ratio(gate['done'], base['done'], 22)} {ratio(gate['wire'], base['wire'], 32)}")


def report_failover(runs: int, healthy: dict, moved: dict) -> None:
    print(f"\n2. first turn on a new gated socket: {runs} runs (ms, median / p95)")
    print(f"{'case':<32} {'create -> first output':>22} {'rejection -> spare 101':>22} {'rejection -> spare turn':>24}")
    print(f"{'healthy credential':<32} {cell(healthy['first'], 22)} {'-':>22} {'-':>24}")
    print(f"{'rejected, moved to the spare':<32} {cell(moved['first'], 22)} {cell(moved['to_handshake'], 22)} "
          f"{cell(moved['to_turn'], 24)}")
    cost = statistics.median(moved["first"]) - statistics.median(healthy["first"])
    print(f"{'    cost of the move (medians)':<32} {cost:+13.2f} ms   {ratio(moved['first'], healthy['first'], 6)}")


def report_throughput(burst: int, turns: int, cases: dict[str, list[float]]) -> None:
    print(f"\n3. throughput: `many` turns of {burst} deltas written in one burst, {turns} turns per case "
          f"(messages/s received by the client)")
    print(f"{'case':<32} {'median':>12} {'min':>12} {'max':>12}")
    for name, rates in cases.items():
        print(f"{name:<32} {statistics.median(rates):12.0f} {min(rates):12.0f} {max(rates):12.0f}")
    print(f"{'    gate / passthrough (medians)':<32} {ratio(cases['(c) gate'], cases['(b) passthrough'], 12)}")


def log_problems(procs: dict[str, ProxyProcess]) -> None:
    """Tracebacks and errors in the mitmdump logs (a measurement over a broken proxy means nothing)."""
    bad = re.compile(r"Traceback|\berror\b|exception", re.IGNORECASE)
    for name, proc in procs.items():
        lines = [line for line in proc.log().splitlines() if bad.search(line)]
        print(f"mitmdump log ({name}): " + ("clean" if not lines else f"{len(lines)} suspicious lines, e.g.:"))
        for line in lines[:5]:
            print("    " + line[:200])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="turns / runs per case (default 30)")
    ap.add_argument("--burst", type=int, default=5000, help="deltas in a throughput turn (default 5000)")
    ap.add_argument("--quick", action="store_true", help="3 runs, 300-delta bursts (a smoke test)")
    args = ap.parse_args()
    runs, burst, bursts = (3, 300, 2) if args.quick else (args.runs, args.burst, 5)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "paced").mkdir(), (tmp / "burst").mkdir(), (tmp / "pass").mkdir()
        procs: dict[str, ProxyProcess] = {}
        fakes: list[FakeUpstreamProcess] = []
        try:
            paced = FakeUpstreamProcess(tmp / "paced", "--trace", "--pace", "0.002", "--deltas", "20")
            fakes.append(paced)
            many = FakeUpstreamProcess(tmp / "burst", "--pace", "0", "--deltas", str(burst))
            fakes.append(many)
            text, env = pool_yaml(paced.base, [("primary", PRIMARY)])
            procs["passthrough"] = ProxyProcess(tmp / "pass", text, env, extra=["--set", "failover_websocket=passthrough"])
            procs["gate"] = gate_proxy(tmp / "gate", paced, [("primary", PRIMARY), ("spare", SPARE)])
            procs["gate, many"] = gate_proxy(tmp / "gate-many", many, [("primary", "sk-test-primary-many-1")])
            procs["relay"] = gate_proxy(tmp / "relay", paced, [("primary", PRIMARY), ("spare", SPARE)], RELAY)
            procs["relay, many"] = gate_proxy(tmp / "relay-many", many, [("primary", "sk-test-primary-many-1")], RELAY)
            print("Responses over WebSocket on 127.0.0.1 (client -> [mitmdump + addon] -> fake upstream); "
                  "the fake paces messages 2 ms apart, 20 deltas a turn")
            report_latency(runs, {
                "(a) no proxy": per_turn(paced, None, runs),
                "(b) passthrough": per_turn(paced, procs["passthrough"].port, runs),
                "(c) gate, healthy credential": per_turn(paced, procs["gate"].port, runs),
                "(d) the same, relay fallback": per_turn(paced, procs["relay"].port, runs),
            })
            report_failover(runs, first_turns(paced, procs["gate"].port, runs, False),
                            first_turns(paced, procs["gate"].port, runs, True))
            report_throughput(burst, bursts, {
                "(a) no proxy": throughput(many, None, "sk-test-client-many", bursts),
                "(b) passthrough": throughput(many, procs["passthrough"].port, "sk-test-client-many", bursts),
                "(c) gate": throughput(many, procs["gate, many"].port, CLIENT_TOKEN, bursts),
                "(d) gate, relay fallback": throughput(many, procs["relay, many"].port, CLIENT_TOKEN, bursts),
            })
            print()
            log_problems(procs)
        finally:
            for p in procs.values():
                p.stop()
            for f in fakes:
                f.stop()
    print(f"wall time {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
