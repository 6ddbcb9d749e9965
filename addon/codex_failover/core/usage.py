"""What each credential has used of its rate-limit windows, from response headers
(`x-codex-primary-used-percent`, `…-reset-at`, `…-reset-after-seconds`) and `codex.rate_limits`
events. A window at 100% means the credential is cooling until that window resets. Pure.
Changes are tracked (`Tracked`) for the state keeper."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

from .tracked import Tracked
from .units import MAX_AHEAD, finite, sane_epoch

WINDOWS = ("primary", "secondary")


@dataclass(frozen=True)
class Window:
    name: str
    used_percent: float
    resets_at: float | None  # epoch seconds


def finite_number(value: Any) -> float | None:
    """`value` as a float, or None (absent, not a number, NaN or infinite)."""
    if value is None:  # most windows' reset-at (and a second window) are absent: no exception for them
        return None
    return finite(value)


def percent(value: Any) -> float | None:
    """A used percentage from outside, within 0-100 (a window is full at 100)."""
    number = finite_number(value)
    return None if number is None else min(max(number, 0.0), 100.0)


def codex_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The `x-codex-*` headers, by lowercase name (repeated ones joined with ", ", as a mapping
    shows them). Read in one pass over a message's own fields when it has them (mitmproxy's
    `Headers.fields`, bytes pairs): its `items()` scans every header once per name, and decodes each,
    which cost a response 40-80 us (docs/measurements.md); a plain mapping is read as one."""
    fields = getattr(headers, "fields", None)
    if not isinstance(fields, tuple):
        return {k.lower(): v for k, v in headers.items() if k[:8].lower() == "x-codex-"}
    found: dict[str, str] = {}
    for name, value in fields:
        if name[:8].lower() == b"x-codex-":
            key, text = name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape")
            found[key] = f"{found[key]}, {text}" if key in found else text
    return found


def from_headers(headers: Mapping[str, str], now: float) -> list[Window]:
    headers = codex_headers(headers)
    if not headers:
        return []
    out = []
    for name in WINDOWS:
        used = percent(headers.get(f"x-codex-{name}-used-percent"))
        if used is None:
            continue
        resets = sane_epoch(headers.get(f"x-codex-{name}-reset-at"))
        after = finite_number(headers.get(f"x-codex-{name}-reset-after-seconds"))
        if resets is None and after is not None:
            resets = now + min(max(after, 0.0), MAX_AHEAD)
        out.append(Window(name, used, resets))
    return out


def from_event(payload: Mapping[str, Any]) -> list[Window]:
    limits = payload.get("rate_limits")
    if not isinstance(limits, dict):
        return []
    out = []
    for name in WINDOWS:
        window = limits.get(name)
        if isinstance(window, dict) and (used := percent(window.get("used_percent"))) is not None:
            out.append(Window(name, used, sane_epoch(window.get("reset_at"))))
    return out


SPEND = "spend_control"  # a Business workspace's spend control, read as one more window


def spend_control(doc: object) -> tuple[bool | None, Window | None]:
    """A usage answer's `spend_control` block (Business accounts under group-based spend controls,
    whose `rate_limit` is null): whether it says the limit is `reached`, and its `individual_limit`
    as a window (`used_percent`, `reset_at`, else `reset_after_seconds` is not read: no clock here).
    (None, None) when the answer has none, or a malformed one."""
    block = doc.get("spend_control") if isinstance(doc, Mapping) else None
    if not isinstance(block, Mapping):
        return None, None
    reached = block.get("reached")
    limit = block.get("individual_limit")
    used = finite_number(limit.get("used_percent")) if isinstance(limit, Mapping) else None
    window = Window(SPEND, used, finite_number(limit.get("reset_at"))) if used is not None and isinstance(limit, Mapping) else None
    return (reached if isinstance(reached, bool) else None), window


class UsageBook(Tracked):
    def __init__(self) -> None:
        super().__init__()
        self._by_key: dict[str, dict[str, Window]] = {}

    def record(self, key: str, windows: list[Window], full_at: float = 100.0) -> float | None:
        """Remember `windows`; the time until which the credential counts as full (a window at
        `full_at` percent or more: 100, or the credential's `max_usage_percent`), if any."""
        if not windows:
            return None
        book = self._by_key.setdefault(key, {})
        for w in windows:
            if book.get(w.name) != w:
                book[w.name] = w
                self._changed(key)
        full = [w.resets_at for w in windows if w.used_percent >= full_at and w.resets_at is not None]
        return max(full) if full else None

    def forget(self, key: str) -> None:
        """The credential's windows no longer hold (its cooldown was ended: they reset)."""
        if self._by_key.pop(key, None) is not None:
            self._changed(key)

    def entries(self) -> dict[str, list[Window]]:
        """Every credential's last known windows (for the state store and the metrics)."""
        return {key: list(book.values()) for key, book in self._by_key.items()}

    def keys(self) -> list[str]:
        return list(self._by_key)

    def windows(self, key: str) -> list[Window]:
        return list(self._by_key.get(key, {}).values())

    def describe(self, key: str) -> str:
        book = self._by_key.get(key)
        if not book:
            return "usage unknown"
        parts = []
        for w in book.values():
            reset = f", resets {time.strftime('%m-%d %H:%M', time.localtime(w.resets_at))}" if w.resets_at else ""
            parts.append(f"{w.name} {w.used_percent:g}%{reset}")
        return "; ".join(parts)
