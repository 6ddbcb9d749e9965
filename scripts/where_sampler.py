"""A mitmproxy script for `scripts/bench --where`: samples the proxy's own CPU time (SIGPROF, so a
sample lands where CPU was spent, never while the loop waits) and counts, for each sample, every
Python function on the stack (inclusive) and the one running (self). Counting starts after
WHERE_SKIP responses (warm-up) and is written to $WHERE_OUT when the process ends."""

from __future__ import annotations

import atexit
import collections
import os
import signal

SKIP = int(os.environ.get("WHERE_SKIP", "300"))
inclusive: collections.Counter[str] = collections.Counter()
running: collections.Counter[str] = collections.Counter()
counted = {"samples": 0, "responses": 0}


def _name(code) -> str:
    path = code.co_filename
    for cut in ("site-packages/", "/addon/codex_failover/"):
        path = path.split(cut)[-1]
    if "/lib/python3." in path:  # the standard library's: asyncio/tasks.py
        path = path.split("/lib/python3.")[-1].split("/", 1)[-1]
    return f"{path}:{code.co_qualname}"


def _sample(_signum, frame) -> None:
    if counted["responses"] < SKIP or frame is None:
        return
    counted["samples"] += 1
    running[_name(frame.f_code)] += 1
    seen: set[str] = set()
    while frame is not None:
        name = _name(frame.f_code)
        if name not in seen:
            seen.add(name)
            inclusive[name] += 1
        frame = frame.f_back


class Where:
    def response(self, flow) -> None:
        counted["responses"] += 1


def _write() -> None:
    out = os.environ.get("WHERE_OUT")
    if not out:
        return
    with open(out, "w") as fh:
        fh.write(f"samples {counted['samples']} responses {max(0, counted['responses'] - SKIP)}\n")
        for name, n in inclusive.most_common(800):
            fh.write(f"I {n} {name}\n")
        for name, n in running.most_common(400):
            fh.write(f"S {n} {name}\n")


signal.signal(signal.SIGPROF, _sample)
signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)  # (the kernel's tick is the real resolution)
atexit.register(_write)
addons = [Where()]
