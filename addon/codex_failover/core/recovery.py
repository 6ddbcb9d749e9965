"""Full-stream recovery (opt-in): keep a whole response until it completes, and retry the same
credential and route on a transient failure, so the client only ever sees one complete response.
Pure: the policy, its bounds, the retry budget (clock and randomness injected) and what counts as
a recoverable failure.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .classifier import stream_error
from .framer import Event
from .units import parse_duration, parse_size
from .vocabulary import NO_TERMINAL

RECOVERABLE_STATUS = frozenset({408, 500, 502, 503, 504, 529})

# (lowest, highest) accepted; a value outside is clamped and reported, a wrong type is an error.
BOUNDS = {
    "attempts": (0, 20),
    "max_buffer_bytes": (64 * 1024, 256 * 1024 * 1024),
    "retry_window": (1.0, 600.0),
    "max_concurrent": (1, 1024),
    "backoff_initial": (0.01, 10.0),
    "backoff_max": (0.01, 60.0),
    "heartbeat": (1.0, 120.0),  # or 0: none
}


class RecoveryConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RecoveryPolicy:
    enabled: bool = False
    attempts: int = 0  # extra attempts; 0: bounded by the window only
    max_buffer_bytes: int = 8 * 1024 * 1024
    retry_window: float = 20.0
    max_concurrent: int = 16
    backoff_initial: float = 0.25
    backoff_max: float = 2.0
    heartbeat: float = 15.0  # 0: none


def parse_recovery(doc: object, where: str) -> tuple[RecoveryPolicy, list[str]]:
    """The `recovery:` section, and notes about values clamped to their bounds."""
    if doc is None:
        return RecoveryPolicy(), []
    if not isinstance(doc, dict):
        raise RecoveryConfigError(f"{where}: expected a mapping")
    allowed = {"enabled", "attempts", "max_buffer_bytes", "retry_window", "max_concurrent", "backoff", "heartbeat"}
    unknown = sorted(map(str, set(doc) - allowed))
    if unknown:
        raise RecoveryConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    backoff = doc.get("backoff") or {}
    if not isinstance(backoff, dict) or set(backoff) - {"initial", "max"}:
        raise RecoveryConfigError(f"{where}.backoff: expected {{initial: 250ms, max: 2s}}")
    enabled = doc.get("enabled", False)
    if not isinstance(enabled, bool):
        raise RecoveryConfigError(f"{where}.enabled: expected true or false, got {enabled!r}")
    notes: list[str] = []
    raw = {
        "attempts": (doc.get("attempts", 0), _count),
        "max_buffer_bytes": (doc.get("max_buffer_bytes", "8MiB"), parse_size),
        "retry_window": (doc.get("retry_window", "20s"), parse_duration),
        "max_concurrent": (doc.get("max_concurrent", 16), _count),
        "backoff_initial": (backoff.get("initial", "250ms"), parse_duration),
        "backoff_max": (backoff.get("max", "2s"), parse_duration),
        "heartbeat": (doc.get("heartbeat", "15s"), parse_duration),
    }
    values = {}
    for name, (value, parse) in raw.items():
        try:
            parsed = parse(value)
        except ValueError as exc:
            raise RecoveryConfigError(f"{where}.{name.replace('backoff_', 'backoff.')}: {exc}") from None
        values[name] = _clamp(name, parsed, notes, where)
    values["backoff_max"] = max(values["backoff_max"], values["backoff_initial"])
    return RecoveryPolicy(enabled=enabled, **values), notes


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return value


class Slots:
    """How many responses are being buffered at once (`max_concurrent`); never blocks."""

    def __init__(self) -> None:
        self.used = 0

    def take(self, limit: int) -> bool:
        if self.used >= limit:
            return False
        self.used += 1
        return True

    def give_back(self) -> None:
        self.used -= 1


def _clamp(name: str, value: Any, notes: list[str], where: str) -> Any:
    if name == "heartbeat" and value == 0:
        return 0.0
    low, high = BOUNDS[name]
    if name == "attempts" and value == 0:
        return 0
    clamped = min(max(value, low), high)
    if clamped != value:
        notes.append(f"{where}.{name.replace('backoff_', 'backoff.')}: {value!r} is outside {low}..{high}; using {clamped!r}")
    return type(value)(clamped)


class RetryBudget:
    """Attempts and time left for one request; full-jitter exponential backoff between attempts."""

    def __init__(self, policy: RecoveryPolicy, clock: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] = random.random):
        self.policy, self._clock, self._rand = policy, clock, rand
        self.started = clock()
        self.retries = 0

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None when the budget is spent. The delay
        never carries the next attempt past the window: no attempt starts after it."""
        p = self.policy
        if p.attempts and self.retries >= p.attempts:
            return None
        cap: float = min(p.backoff_max, p.backoff_initial * 2 ** self.retries)
        delay = self._rand() * cap
        if self._clock() + delay >= self.started + p.retry_window:
            return None
        self.retries += 1
        return delay


def _may_be_terminal(raw: bytes) -> bool:
    """Could a JSON string in `raw` be `error` or a terminal `response.*` type? (A byte search; a
    `\\u` escape may spell any of them, so it is parsed then.)"""
    return (b"error" in raw or b"response.completed" in raw or b"response.failed" in raw
            or b"response.incomplete" in raw or b"\\u" in raw)


class TerminalTracker:
    """How a stream ended: the last terminal event seen (and its error object). An event whose bytes
    hold neither a terminal type's name nor a `\\u` escape (through which a JSON string could spell
    one) cannot be terminal, and is not parsed: a stream's deltas cost a byte search each."""

    TERMINALS = ("response.completed", "response.failed", "response.incomplete")

    def __init__(self) -> None:
        self.terminal: str | None = None
        self.error: Mapping[str, Any] | None = None

    def see(self, event: Event) -> None:
        if not _may_be_terminal(event.raw):
            return
        kind, payload = event.type, event.payload
        if not isinstance(payload, dict):  # no JSON object: no `type` either (framer.Event.type)
            return
        if kind in self.TERMINALS:
            self.terminal = kind
            self.error = stream_error(payload) if kind == "response.failed" else None
        elif kind == "error" and self.terminal is None:
            self.terminal, self.error = kind, stream_error(payload)

    def unframed(self) -> None:
        """The framer gave up: the end cannot be seen, so whatever comes is final (never retried)."""
        self.terminal, self.error = "unframed", None


def recoverable_stream_end(terminal: str | None, error: Mapping[str, Any] | None) -> str | None:
    """Why a finished stream should be retried (a reason class), or None when it is final."""
    if terminal == "response.completed" or terminal == "response.incomplete":
        return None
    if terminal is None:
        return NO_TERMINAL
    error = error or {}
    status = error.get("status")
    if isinstance(status, int) and status in RECOVERABLE_STATUS:
        return f"status_{status}"
    if "server_error" in (str(error.get("code") or "").lower(), str(error.get("type") or "").lower()):
        return "server_error"
    return None
