"""Parsing of human-written durations and sizes from config and the command line."""

from __future__ import annotations

import math
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|h|m|s)")
_DURATION_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_UNLIMITED = {"none", "off", "unlimited"}

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(b|kb|kib|k|mb|mib|m|gb|gib|g)?", re.IGNORECASE)
_SIZE_UNIT = {
    None: 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
}


def parse_duration(value: object) -> float:
    """Seconds from `20s`, `500ms`, `1h30m`, `2.5`, 30; `none`/`off`/`unlimited` mean 0.

    Raises ValueError naming the bad value: garbage is never silently 0.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration_text(value.strip().lower())
    else:
        raise ValueError(f"not a duration: {value!r}")
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"duration must be a finite number >= 0: {value!r}")
    return seconds


def _parse_duration_text(text: str) -> float:
    if text in _UNLIMITED:
        return 0.0
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNIT[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        raise ValueError(f"not a duration: {text!r} (examples: 20s, 500ms, 1h30m, 30, off)")
    return total


def parse_size(value: object) -> int:
    """Bytes from `1MiB`, `512KiB`, `8MB`, `4096`."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value.strip())
        if not m:
            raise ValueError(f"not a size: {value!r} (examples: 1MiB, 512KiB, 4096)")
        unit = m.group(2).lower() if m.group(2) else None
        size = int(float(m.group(1)) * _SIZE_UNIT[unit])
    else:
        raise ValueError(f"not a size: {value!r}")
    if size < 0:
        raise ValueError(f"size must be >= 0: {value!r}")
    return size


# -- times from outside ---------------------------------------------------------------------------
# An upstream's headers, a state row another version (or a teammate's proxy) wrote: a number there
# can be anything, `1e20` or `Infinity`. Nothing the proxy keeps is meant to last past these.

MAX_AHEAD = 31 * 86400.0  # the farthest a cooldown, a backoff or a window's reset may be (a week's window, and then some)
MAX_EPOCH = 4102444800.0  # 2100-01-01: past it an epoch time is nonsense (and past the status page's dates)


def finite(value: object) -> float | None:
    """`value` as a finite float (not a bool), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def sane_until(value: object, now: float, ahead: float = MAX_AHEAD) -> float | None:
    """An epoch time from outside, at most `ahead` seconds after `now` (clamped: `Infinity` too); None
    if not a number (NaN, -Infinity)."""
    if value == math.inf:
        return now + ahead
    number = finite(value)
    return None if number is None else min(number, now + ahead)


def sane_epoch(value: object) -> float | None:
    """An epoch time from outside (milliseconds read as such): None if not finite, negative or past 2100."""
    number = finite(value)
    if number is not None and number > 1e11:
        number /= 1000.0
    return number if number is not None and 0 <= number <= MAX_EPOCH else None
