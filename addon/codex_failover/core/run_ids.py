"""A short id for this run of the proxy, in front of every request and WebSocket id (`k3x9-r1`,
`k3x9-w1`), so ids stay unique across restarts: a service's journal holds many runs, and `[r1]`
alone would name a request of each of them. Pure.

The id is the start time in seconds, base 36, last four digits: it differs for any two starts at
least a second apart within 19 days (36**4 s), needs no state on disk, and reads as one short word.
"""

from __future__ import annotations

import time

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
WIDTH = 4


def run_id(now: float | None = None) -> str:
    n = int(time.time() if now is None else now) % len(DIGITS) ** WIDTH
    out = ""
    for _ in range(WIDTH):
        n, d = divmod(n, len(DIGITS))
        out = DIGITS[d] + out
    return out
