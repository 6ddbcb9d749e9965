"""What mitmweb shows of a failover: each attempt's mark, comment and error, and the client flow's
comment telling the whole request. Pure text from the run's records (docs/observability.md).

Marks are shortcodes from mitmproxy's emoji table (`mitmproxy/utils/emoji.py`): mitmweb shows
`flow.marked` through that table, and anything else (a raw emoji included) as a red circle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .vocabulary import INCOMPLETE_RESPONSE, RESPONSE_TIMEOUT, Verdict

if TYPE_CHECKING:
    from .health import State
    from .policy import PoolConfig

SERVED = ":white_check_mark:"  # committed or delivered: the client got this attempt
REJECTED = ":x:"  # a rejection (in-stream or by status): failed over
RETRIED = ":arrows_counterclockwise:"  # recovery retries the same credential
CANCELLED = ":no_entry_sign:"  # stopped by the addon (the client left)
TIMED_OUT = ":hourglass:"  # no (complete) answer in time
NO_CONNECTION = ":electric_plug:"  # the connection failed (refused, unreachable, TLS)

_TIMEOUTS = (RESPONSE_TIMEOUT, INCOMPLETE_RESPONSE)
_NOT_SERVED = (Verdict.FAILOVER, Verdict.FAILED, Verdict.RECOVER)
_WORDS: dict[str, str] = {Verdict.FAILOVER: "rejected", Verdict.RECOVER: "retried", Verdict.CANCELLED: "cancelled", Verdict.FAILED: "failed"}


@dataclass
class AttemptLog:
    """One attempt's line in the story: what run_log.py records for each attempt, and what the story
    tells of it."""

    n: int
    credential: str
    verdict: str
    reason: str
    elapsed_ms: int
    status: int | None = None

    route: str = "direct"

    def as_dict(self) -> dict[str, Any]:
        return {"attempt": self.n, "credential": self.credential, "route": self.route,
                "verdict": self.verdict, "reason": self.reason, "status": self.status}


@dataclass(frozen=True)
class Skipped:
    """A credential the plan passed over without dialling."""

    name: str
    status: str  # cooling, out, expired
    until: float | None = None  # wall clock, for cooling
    reason: str | None = None

    def describe(self) -> str:
        text = f"{self.name}: skipped, {self.status}"
        if self.status == "cooling" and self.until is not None:
            text = f"{self.name}: skipped, cooling until {time.strftime('%H:%M:%S', time.localtime(self.until))}"
        elif self.status == "out":
            text = f"{self.name}: skipped, out of rotation"
        elif self.status == "expired":
            text = f"{self.name}: skipped, token expired (run codex login)"
        return f"{text} ({self.reason})" if self.reason else text


def mark(verdict: str, reason: str, ok: bool) -> str:
    if ok:
        return SERVED
    if verdict == Verdict.FAILOVER:
        return REJECTED
    if verdict == Verdict.RECOVER:
        return RETRIED
    if verdict == Verdict.CANCELLED:
        return CANCELLED
    return TIMED_OUT if reason in _TIMEOUTS else NO_CONNECTION


def attempt_error(verdict: str, reason: str) -> str:
    """The error a losing attempt's flow shows, instead of the protocol error its cancel caused."""
    return f"codex-failover: {_WORDS.get(verdict, verdict)}: {reason}"


def attempt_line(entry: AttemptLog) -> str:
    status = f", HTTP {entry.status}" if entry.status is not None else ""
    return (f"attempt {entry.n}: {entry.credential} via {entry.route}: {entry.verdict} ({entry.reason}){status}, "
            f"{entry.elapsed_ms} ms")


def attempt_comment(request_id: str, entry: AttemptLog, total: int) -> str:
    """What happened first (mitmweb's Comment column cuts long text), then whose request it was."""
    line = attempt_line(entry).replace(f"attempt {entry.n}:", f"attempt {entry.n}/{total}:", 1)
    return f"{line} (codex-failover {request_id})"


def summary(history: Sequence[AttemptLog], outcome: str | None) -> str:
    count = f"{len(history)} attempt{'s' if len(history) != 1 else ''}"
    rejected = [e.reason for e in history if e.verdict in _NOT_SERVED]
    after = f" after {', '.join(dict.fromkeys(rejected))}" if rejected else ""
    served = next((e for e in reversed(history) if e.verdict not in (*_NOT_SERVED, Verdict.CANCELLED)), None)
    if outcome is None and served is not None:
        return f"failover: {count}, served by {served.credential}{after}"
    if outcome is None:
        return f"failover: {count} so far{after}"
    return f"failover: {count}, {outcome}"


def request_comment(history: Sequence[AttemptLog], skipped: Mapping[str, Skipped], pinned: str | None, outcome: str | None = None,
                    request_id: str = "") -> str:
    """The summary line, then a bulleted line per fact: mitmweb's comment box shows newlines as
    spaces, so the bullets keep the lines apart there."""
    lines = []
    if pinned:
        lines.append(f"stays on its own credential: {pinned}")
    lines += [f"{request_id} {attempt_line(e)}".lstrip() for e in history]
    tried = {e.credential for e in history}
    lines += [s.describe() for s in skipped.values() if s.name not in tried]
    return "\n".join([summary(history, outcome)] + [f"• {line}" for line in lines])


def bound_to(key: str | None, pool: PoolConfig) -> str:
    """How a request that cannot move is placed, for its log line: on the pooled credential that
    holds its state, or on its own."""
    if key and any(c.name == key for c in pool.credentials):
        return f"goes only to credential {key}"
    return "stays on its own credential"


def nobody_to_serve(states: Sequence[tuple[str, str, str | None]], movable: bool) -> str:
    """The summary of an answer given without dialling: a request bound to one credential names it
    and its condition; otherwise every credential was cooling or out."""
    if movable or not states:
        return "every credential cooling or out"
    name, status, reason = states[0]
    return f"credential {name}, which holds this request's state, is {status}" + (f" ({reason})" if reason else "")


def skipped_line(name: str, status: str, state: State, now: float) -> str:
    """A credential the plan passed over, for the request's log line: `client cooling (usage_limit,
    59m left)`."""
    left = ""
    if status == "cooling" and state.until is not None:
        seconds = max(0, int(state.until - now))
        left = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m left" if seconds >= 3600 else (
            f"{seconds // 60}m left" if seconds >= 60 else f"{seconds}s left")
    detail = ", ".join(x for x in (state.reason, left) if x)
    return f"{name} {status}" + (f" ({detail})" if detail else "")
