"""Framer benchmark: our SSEFramer vs a naive baseline vs httpx-sse's decoders, in one run.

Framing only: no implementation parses JSON. Each (workload, implementation) pair runs
--repeat times; the table shows the median. MB/s means 10^6 bytes per second of input.

Workloads:
  W1  a Codex-like SSE stream (~10 MiB) fed in 1 KiB chunks
  W2  the same kind of stream, smaller (1 MiB), fed in 1-byte chunks
  W3  one single 2 MiB event (one data line) fed in 1 KiB chunks

Implementations:
  ours    codex_failover.core.framer.SSEFramer (feed/close, events counted, not parsed)
  naive   keeps a bytes buffer; every chunk is joined onto it and the whole buffer re-split
          on blank lines (LF only), so a long event is rescanned once per chunk: quadratic in
          the event size (W3), but only ~event-size work per chunk on W2, so it is not skipped
          there; any run over --budget seconds would be
  httpx   httpx-sse as it runs under httpx: incremental UTF-8 decode -> SSELineDecoder ->
          SSEDecoder.decode per line (events counted)

A run that goes past --budget seconds is abandoned and marked as skipped.
"""

from __future__ import annotations

import argparse
import codecs
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from codex_failover.core.framer import SSEFramer

KiB = 1024
MiB = 1024 * KiB
BATCH = 4096  # chunks between deadline checks (kept out of the per-chunk loop)


# -- workloads -------------------------------------------------------------------------------

_WORDS = (
    "the", "model", "streams", "tokens", "to", "Codex", "while", "reasoning", "about", "a",
    "patch", "for", "framer.py", "with", "tests", "and", "benchmarks", "héllo", "✓", "naïve",
    "`code`", "\"quoted\"", "line\nbreak", "tab\there", "{braces}", "path/to/file", "→", "ok",
)


def _sse(kind: str, payload: dict) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _delta_text(rng: random.Random) -> str:
    # 0..~100 characters of text: events end up ~150-400 bytes on the wire.
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 14)))


def codex_stream(size: int, seed: int = 1) -> bytes:
    """A deterministic Codex-like Responses stream of about `size` bytes (LF line ends)."""
    rng = random.Random(seed)
    resp = {"id": "resp_0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e", "object": "response", "created_at": 1795967379,
            "model": "gpt-5-codex", "output": [], "usage": None, "error": None}
    rs_id, msg_id = "rs_" + "a1b2c3d4" * 4, "msg_" + "e5f6a7b8" * 4
    seq = 0

    def ev(kind: str, **payload) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(kind, {"sequence_number": seq, **payload})

    parts = [
        ev("response.created", response={**resp, "status": "in_progress"}),
        ev("response.in_progress", response={**resp, "status": "in_progress"}),
        ev("response.output_item.added", output_index=0,
           item={"id": rs_id, "type": "reasoning", "summary": [], "encrypted_content": None}),
        ev("response.reasoning_summary_part.added", item_id=rs_id, output_index=0, summary_index=0,
           part={"type": "summary_text", "text": ""}),
    ]
    total = sum(map(len, parts))
    tail_reserve = 8 * KiB
    reasoning_until = size // 5  # first ~20% reasoning summary deltas, then output text deltas
    phase = "reasoning"
    while total < size - tail_reserve:
        if phase == "reasoning" and total >= reasoning_until:
            phase = "text"
            extra = [
                ev("response.reasoning_summary_text.done", item_id=rs_id, output_index=0, summary_index=0,
                   text="(summary elided)"),
                ev("response.output_item.done", output_index=0,
                   item={"id": rs_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": "..."}]}),
                ev("response.output_item.added", output_index=1,
                   item={"id": msg_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}),
                ev("response.content_part.added", item_id=msg_id, output_index=1, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": []}),
            ]
        elif phase == "reasoning":
            extra = [ev("response.reasoning_summary_text.delta", item_id=rs_id, output_index=0, summary_index=0,
                        delta=_delta_text(rng), obfuscation=f"{rng.getrandbits(40):010x}")]
        else:
            extra = [ev("response.output_text.delta", item_id=msg_id, output_index=1, content_index=0,
                        delta=_delta_text(rng), logprobs=[], obfuscation=f"{rng.getrandbits(40):010x}")]
        parts += extra
        total += sum(map(len, extra))
    text = "(full text elided)"
    part = {"type": "output_text", "text": text, "annotations": []}
    message = {"id": msg_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
    parts += [
        ev("response.output_text.done", item_id=msg_id, output_index=1, content_index=0, text=text, logprobs=[]),
        ev("response.content_part.done", item_id=msg_id, output_index=1, content_index=0, part=part),
        ev("response.output_item.done", output_index=1, item=message),
        ev("response.completed", response={**resp, "status": "completed", "output": [message],
                                           "usage": {"input_tokens": 12000, "output_tokens": seq,
                                                     "total_tokens": 12000 + seq}}),
    ]
    return b"".join(parts)


def single_event(size: int) -> bytes:
    """One event whose one data line makes it `size` bytes long."""
    head, tail = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"', b'"}\n\n'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def chunked(data: bytes, step: int) -> list[list[bytes]]:
    """The input cut into `step`-byte chunks, grouped in batches for the deadline checks."""
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    return [chunks[i : i + BATCH] for i in range(0, len(chunks), BATCH)]


# -- implementations -------------------------------------------------------------------------
# Each takes the batched chunks and a deadline and returns the number of events.


class TooSlow(Exception):
    pass


def run_ours(batches: list[list[bytes]], deadline: float) -> int:
    framer = SSEFramer()
    n = 0
    for batch in batches:
        if time.perf_counter() > deadline:
            raise TooSlow
        for chunk in batch:
            n += len(framer.feed(chunk))
    return n + len(framer.close())


def run_naive(batches: list[list[bytes]], deadline: float) -> int:
    buf = b""
    n = 0
    for batch in batches:
        if time.perf_counter() > deadline:
            raise TooSlow
        for chunk in batch:
            buf = buf + chunk
            parts = buf.split(b"\n\n")  # rescans the whole pending buffer every time
            buf = parts.pop()
            n += len([p + b"\n\n" for p in parts])  # build each event's raw bytes, like the others do
    return n + (1 if buf else 0)


def run_httpx(batches: list[list[bytes]], deadline: float) -> int:
    text_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # what httpx uses
    lines = SSELineDecoder()
    sse = SSEDecoder()
    n = 0
    for batch in batches:
        if time.perf_counter() > deadline:
            raise TooSlow
        for chunk in batch:
            text = text_decoder.decode(chunk)
            if text:  # httpx drops empty text (e.g. mid UTF-8 sequence)
                for line in lines.decode(text):
                    if sse.decode(line) is not None:
                        n += 1
    text = text_decoder.decode(b"", True)
    for line in (lines.decode(text) if text else []) + lines.flush():
        if sse.decode(line) is not None:
            n += 1
    return n


IMPLS: dict[str, Callable[[list[list[bytes]], float], int]] = {
    "ours": run_ours,
    "naive": run_naive,
    "httpx-sse": run_httpx,
}


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Result:
    events: int | None = None
    times: list[float] | None = None
    skipped: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times or [float("nan")])


def measure(fn, batches, repeat: int, budget: float) -> Result:
    times, events = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            count = fn(batches, start + budget)
        except TooSlow:
            return Result(skipped=f"skipped (> {budget:g} s per run: quadratic)")
        times.append(time.perf_counter() - start)
        events = count
    return Result(events=events, times=times)


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def fmt(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small inputs, 3 repeats (a smoke run)")
    ap.add_argument("--repeat", type=int, help="runs per cell (default 5, or 3 with --quick)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds one run may take before it is skipped")
    args = ap.parse_args()
    repeat = args.repeat or (3 if args.quick else 5)
    s1, s2, s3 = (1 * MiB, 128 * KiB, 256 * KiB) if args.quick else (10 * MiB, 1 * MiB, 2 * MiB)

    stream1 = codex_stream(s1)
    stream2 = codex_stream(s2)
    big = single_event(s3)
    workloads = [
        ("W1", f"Codex-like stream {len(stream1) / MiB:.1f} MiB, 1 KiB chunks", stream1, 1 * KiB),
        ("W2", f"Codex-like stream {len(stream2) / MiB:.2f} MiB, 1-byte chunks", stream2, 1),
        ("W3", f"one {len(big) / MiB:.2f} MiB event (one data line), 1 KiB chunks", big, 1 * KiB),
    ]
    print(f"python {sys.version.split()[0]}, repeat={repeat}, budget={args.budget:g} s/run, "
          f"MB = 10^6 bytes, median of runs; 'vs ours' = throughput / ours (>1 is faster than ours)")
    sizes = [len(e) for e in stream1.split(b"\n\n")[:-1]]
    print(f"W1 events: {len(sizes)}, {min(sizes) + 2}-{max(sizes) + 2} bytes, "
          f"median {statistics.median(sizes) + 2:.0f} bytes")
    print()

    header = f"{'workload':<8} {'impl':<10} {'events':>7} {'median s':>9} {'MB/s':>8} {'min..max MB/s':>17} {'vs ours':>8}"
    print(header)
    print("-" * len(header))
    results: dict[tuple[str, str], Result] = {}
    ok = True
    for wid, desc, data, step in workloads:
        print(f"{wid}: {desc}")
        batches = chunked(data, step)
        for name, fn in IMPLS.items():
            res = results[wid, name] = measure(fn, batches, repeat, args.budget)
            if res.skipped:
                print(f"{'':<8} {name:<10} {res.skipped}")
                continue
            med = mbps(len(data), res.median)
            lo, hi = mbps(len(data), max(res.times)), mbps(len(data), min(res.times))
            vs = med / mbps(len(data), results[wid, "ours"].median)
            print(f"{'':<8} {name:<10} {res.events:>7} {res.median:>9.4f} {fmt(med):>8} "
                  f"{f'{fmt(lo)}..{fmt(hi)}':>17} {vs:>7.3f}x")
        counts = {name: r.events for (w, name), r in results.items() if w == wid and not r.skipped}
        same = len(set(counts.values())) == 1
        ok &= same
        print(f"{'':<8} sanity: event counts {'agree' if same else 'DIFFER'}: "
              + ", ".join(f"{k}={v}" for k, v in counts.items()))
        # Our framer must also be byte-exact: the raws concatenate back to the input.
        framer = SSEFramer()
        raws = [e.raw for c in (x for b in batches for x in b) for e in framer.feed(c)]
        raws += [e.raw for e in framer.close()]
        exact = b"".join(raws) == data
        ok &= exact
        print(f"{'':<8} sanity: our raws concatenate to the input: {'yes' if exact else 'NO'}")

    print()
    w1, w3 = results["W1", "ours"], results["W3", "ours"]
    per_byte = (w3.median / len(big)) / (w1.median / len(stream1))
    w1_mbps = mbps(len(stream1), w1.median)
    print(f"ours W1 throughput: {w1_mbps:.1f} MB/s (target >= 100): {'OK' if w1_mbps >= 100 else 'MISSED'}")
    print(f"ours per-byte cost W3 / W1: {per_byte:.2f}x (target <= 2): {'OK' if per_byte <= 2 else 'MISSED'}")
    naive3 = results["W3", "naive"]
    if not naive3.skipped:
        print(f"naive per-byte cost W3 / W1: "
              f"{(naive3.median / len(big)) / (results['W1', 'naive'].median / len(stream1)):.1f}x "
              f"(quadratic: the pending event is rescanned on every chunk)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
