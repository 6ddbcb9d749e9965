"""A growing Codex session on both transports, side by side in one run: what HTTP/SSE re-sends
against the gated WebSocket. Run as `scripts/bench --session [--turns 10 30] [--uplink-mbit 10] [--rtt-ms 30]`.

Each session is one Codex-like conversation of T requests (a first request, then T-1 tool-call
rounds): every request carries Codex's instructions (--instructions-kib) and the conversation so far.
Over HTTP (`failover_websocket=downgrade`, today's default) every POST re-sends the whole input; over
the gate (`failover_websocket=gate`) a turn after the first sends only its new items with
`previous_response_id`, as Codex does on its WebSocket. Each round adds the model's tool call, its
output (--output-kib) and, as the history Codex keeps, the model's text (--model-kib).

The client reaches the proxy through a user-space link (one asyncio relay on 127.0.0.1): the
client's bytes to the proxy go at --uplink-mbit, and each direction waits RTT/2 before it is written
(a user-space delay; the kernel here has no netem). The relay counts the bytes each way. Both
configurations are mitmdump with the addon and one healthy credential, against one fake upstream; the
sessions take turns (HTTP, gate, HTTP, gate, ...).

Reported per transport and session length (medians over --sessions sessions): bytes the client
uploaded (JSON and the HTTP or WebSocket framing around it, as on the wire without TLS), time per
request (sent -> response.completed), first output (sent -> the first output delta), the session's
total time, and the proxy's CPU per request (utime+stime from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ProcStats  # noqa: E402

try:
    from compression import zstd  # Python 3.14
except ImportError:
    from backports import zstd  # what mitmproxy brings
from harness import FakeUpstreamProcess, ProxyProcess, WsClient, WsRejected, pool_yaml, post_responses  # noqa: E402

OUTPUT = ("response.reasoning_summary_text.delta", "response.output_text.delta")
KEY = "sk-test-client-good"  # the client's own credential: it serves (the pool has a spare)
SPARE = "sk-test-spare-good"


class Link:
    """A TCP relay on 127.0.0.1 in its own thread: client -> target at `mbit` Mbit/s, both
    directions delayed by `rtt`/2, bytes counted each way."""

    def __init__(self, target: int, mbit: float, rtt: float):
        self.target, self.rate, self.half = target, mbit * 1e6 / 8, rtt / 2
        self.up = self.down = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        if not self.ready.wait(10):
            raise RuntimeError("link did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _conn(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False),
                             return_exceptions=True)

    async def _pipe(self, reader, writer, upload: bool) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():  # in order, each chunk RTT/2 after it was read (and, upstream, paced)
            free_at = 0.0
            while (item := await queue.get()) is not None:
                due, data = item
                if upload:
                    start = max(due, free_at)
                    free_at = start + len(data) / self.rate
                    due = free_at
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.get_running_loop().create_task(deliver())
        try:
            while data := await reader.read(65536):
                if upload:
                    self.up += len(data)
                else:
                    self.down += len(data)
                queue.put_nowait((time.monotonic() + self.half, data))
        finally:
            queue.put_nowait(None)
            await task

    def counts(self) -> tuple[int, int]:
        return self.up, self.down


WORDS = ("the function returns a value when the input list is empty so we check the length first and "
         "then call parse on each item of the config file which holds paths tests and the build target").split()


def prose(kib: int, seed: int) -> str:
    """`kib` KiB of word salad: text that compresses about as much as Codex's own (3-4x), unlike a
    repeated byte (the WebSocket's permessage-deflate would shrink that to nothing)."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < kib * 1024:
        word = rng.choice(WORDS) + (str(rng.randrange(1000)) if rng.random() < 0.2 else "")
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def items_for_round(n: int, output_kib: int, model_kib: int) -> list[dict]:
    """What one tool-call round adds to the conversation: the model's text, its call, the output."""
    call = f"call_{n}"
    out = [{"type": "function_call", "call_id": call, "name": "shell",
            "arguments": json.dumps({"command": ["ls", f"dir{n}"]})},
           {"type": "function_call_output", "call_id": call, "output": prose(output_kib, 2 * n)}]
    if model_kib:
        out.insert(0, {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": prose(model_kib, 2 * n + 1)}]})
    return out


def base_body(args) -> dict:
    return {"model": "gpt-fake", "stream": True, "store": False, "instructions": prose(args.instructions_kib, -1),
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]}]}


def http_session(link: Link, fake, args, turns: int, sid: str) -> list[tuple[float, float]]:
    body, times = base_body(args), []
    for n in range(turns):
        sent = time.monotonic()
        payload = json.dumps(body).encode()
        headers = {"session-id": sid}
        if args.zstd:  # as Codex 0.171 sends its POSTs in ChatGPT mode
            payload, headers["content-encoding"] = zstd.compress(payload), "zstd"
        reply = post_responses(link.port, f"{fake.base}/v1/responses", KEY, payload, headers=headers, timeout=60)
        done = time.monotonic()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.body[:200]!r}")
        seen = reply.first_seen_at(b"_text.delta")  # the first reasoning or text delta, fully arrived
        times.append((done - sent, seen - reply.started_at if seen is not None else done - sent))
        body["input"] = body["input"] + items_for_round(n, args.output_kib, args.model_kib)
    return times


def ws_session(link: Link, fake, args, turns: int, sid: str) -> list[tuple[float, float]]:
    headers = {"authorization": f"Bearer {KEY}", "openai-beta": "responses_websockets=2026-02-06", "session-id": sid}
    client = WsClient.connect(link.port, f"{fake.base}/v1/responses", headers)
    if isinstance(client, WsRejected):
        raise RuntimeError(f"upgrade refused: {client}")
    times, body, previous = [], base_body(args), None
    try:
        for n in range(turns):
            create = {"type": "response.create", **body}
            if previous is not None:
                create["previous_response_id"] = previous
            sent = time.monotonic()
            client.send_json(create)
            first = None
            while True:
                kind, *rest = client.recv(60)
                if kind == "close":
                    raise RuntimeError(f"turn {n}: closed {rest}")
                if kind != "text":
                    continue
                event = json.loads(rest[0])
                if first is None and event.get("type") in OUTPUT:
                    first = time.monotonic()
                if event.get("type") in ("response.completed", "response.failed", "error"):
                    break
            done = time.monotonic()
            if event.get("type") != "response.completed":
                raise RuntimeError(f"turn {n}: {event}")
            previous = event["response"]["id"]
            times.append((done - sent, (first or done) - sent))
            body = {k: v for k, v in body.items() if k != "input"} | {"input": items_for_round(n, args.output_kib, args.model_kib)}
    finally:
        client.close()
    return times


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench --session", description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 30], help="requests per session (each length is measured)")
    ap.add_argument("--sessions", type=int, default=3, help="sessions per transport and length")
    ap.add_argument("--uplink-mbit", type=float, default=10.0)
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--instructions-kib", type=int, default=24, help="Codex's instructions and tools, sent each request")
    ap.add_argument("--output-kib", type=int, default=2, help="each tool call's output")
    ap.add_argument("--model-kib", type=int, default=0, help="the model's text per round kept in the history")
    ap.add_argument("--no-zstd", dest="zstd", action="store_false",
                    help="send HTTP bodies uncompressed (Codex in API-key mode); by default zstd, as in ChatGPT mode")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="codex-failover-bench-session-") as tmp:
        tmp = Path(tmp)
        fake = FakeUpstreamProcess(tmp / "fake", "--pace", "0.002", "--deltas", "5")
        text, env = pool_yaml(fake.base, [("spare", SPARE)])
        proxies = {mode: ProxyProcess(tmp / mode, text, env, extra=["--set", f"failover_websocket={mode}"])
                   for mode in ("downgrade", "gate")}
        links = {mode: Link(p.port, args.uplink_mbit, args.rtt_ms / 1000) for mode, p in proxies.items()}
        run = {"downgrade": http_session, "gate": ws_session}
        try:
            for turns in args.turns:
                for i in range(args.sessions):
                    for mode, proxy in proxies.items():
                        stats, link = ProcStats(proxy.proc.pid), links[mode]
                        c0, (u0, _) = stats.cpu(), link.counts()
                        t0 = time.monotonic()
                        times = run[mode](link, fake, args, turns, f"bench-{mode}-{turns}-{i}")
                        took = time.monotonic() - t0
                        time.sleep(0.2)  # the link's last bytes
                        cell = out.setdefault(f"{mode} {turns}", {"up": [], "session": [], "turn": [], "first": [], "cpu": []})
                        cell["up"].append(link.counts()[0] - u0)
                        cell["session"].append(took)
                        cell["turn"] += [t for t, _ in times]
                        cell["first"] += [f for _, f in times]
                        cell["cpu"].append((stats.cpu() - c0) / turns)
        finally:
            for proxy in proxies.values():
                proxy.stop()
            fake.stop()
    print(f"codex-failover session benchmark: uplink {args.uplink_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms, "
          f"instructions {args.instructions_kib} KiB, tool output {args.output_kib} KiB, model text {args.model_kib} KiB "
          f"per round; HTTP bodies {'zstd' if args.zstd else 'uncompressed'}; {args.sessions} sessions per cell")
    print(f"\n{'':<16}{'uploaded KiB':>14}{'x gate':>8}{'session s':>11}{'per request ms':>16}{'p95':>8}"
          f"{'first output ms':>17}{'CPU ms/req':>12}")
    med = statistics.median
    for turns in args.turns:
        gate_up = med(out[f"gate {turns}"]["up"])
        for mode, name in (("downgrade", "HTTP/SSE"), ("gate", "WebSocket")):
            c = out[f"{mode} {turns}"]
            p95 = statistics.quantiles(c["turn"], n=20)[-1] * 1000 if len(c["turn"]) > 1 else c["turn"][0] * 1000
            first = f"{med(c['first']) * 1000:17.1f}"
            print(f"{name + f', {turns} req':<16}{med(c['up']) / 1024:14.0f}{med(c['up']) / gate_up:8.1f}"
                  f"{med(c['session']):11.2f}{med(c['turn']) * 1000:16.1f}{p95:8.1f}{first}{med(c['cpu']) * 1000:12.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "cells": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
