"""`scripts/classify`: what would the addon have decided on this captured stream?

Feeds a raw SSE body through the framer and the bootstrap classifier and prints one JSON
object. The end of the file is not, by default, the end of the stream: a capture may stop while
the stream is still open. Then an armed `--timeout` expires (commit), or, without one, the
verdict is "hold". `--eof` treats the end of the file as the upstream closing the stream.
"""

from __future__ import annotations

import argparse
import json
import sys

from .core.classifier import BootstrapClassifier, Decision
from .core.framer import FramerError, SSEFramer
from .core.rules import RulesError
from .core.units import parse_duration
from .core.vocabulary import FRAMING_ERROR
from .rules_file import load_rules


class _FrozenClock:
    """Time stands still while the file is fed; it only moves when the input is exhausted."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="classify", description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a raw SSE response body, or - for stdin")
    ap.add_argument("--rules", help="rules file (default: rules/default.yaml)")
    ap.add_argument("--chunk", type=int, default=0, help="feed N bytes at a time (default: all at once)")
    ap.add_argument("--timeout", default="0", help="bootstrap timeout, e.g. 30s, 500ms, off (default: off)")
    ap.add_argument("--eof", action="store_true", help="the end of the file is the upstream closing the stream")
    args = ap.parse_args(argv)
    if args.chunk < 0:
        ap.error("--chunk must be >= 0")
    try:
        args.timeout = parse_duration(args.timeout)
    except ValueError as exc:
        ap.error(f"--timeout: {exc}")
    return args


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as fh:
        return fh.read()


def classify_bytes(body: bytes, classifier: BootstrapClassifier, clock: _FrozenClock, chunk: int, eof: bool) -> Decision:
    framer = SSEFramer()
    step = chunk or max(len(body), 1)
    decision = None
    try:
        for i in range(0, len(body), step):
            for event in framer.feed(body[i : i + step]):
                decision = _first_final(decision, classifier.feed(event))
        for event in framer.close():
            decision = _first_final(decision, classifier.feed(event))
    except FramerError:
        decision = _first_final(decision, classifier.fail_open(FRAMING_ERROR))
    if decision is None or not decision.final:
        if eof:
            decision = classifier.end()
        elif classifier.deadline is not None:
            clock.now = classifier.deadline
            decision = classifier.tick()
    return decision or classifier.tick()


def _first_final(current: Decision | None, new: Decision) -> Decision:
    return current if current is not None and current.final else new


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        rules = load_rules(args.rules)
    except RulesError as exc:
        print(f"classify: {exc}", file=sys.stderr)
        return 2
    try:
        body = _read(args.file)
    except OSError as exc:
        print(f"classify: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    clock = _FrozenClock()
    classifier = BootstrapClassifier(rules, timeout=args.timeout, clock=clock)
    decision = classify_bytes(body, classifier, clock, args.chunk, args.eof)
    result = {
        "verdict": decision.verdict.value,
        "reason": decision.reason,
        "trigger": decision.trigger,
        "held_frames": classifier.held_frames,
        "held_bytes": classifier.held_bytes,
        "events": classifier.events_seen,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
