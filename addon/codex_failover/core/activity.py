"""What the proxy did since it started, for the dashboard: the recent model requests (a bounded ring)
and the counts (served, moved away, rejections by reason). Pure: the shell records, the dashboard
reads (core/dashboard.py); times are passed in.

A request's record is filled in as it goes: its attempts (credential, verdict, reason), the time to
the client's first output, and the tokens its `response.completed` event reported (read from the
winner's stream when the dashboard asks: `tokens_from`).
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .vocabulary import Verdict

RECENT = 50  # requests the dashboard shows (the ring's size)
_NOT_SERVED = (Verdict.FAILOVER, Verdict.FAILED, Verdict.RECOVER)
_SERVED = (Verdict.COMMIT, Verdict.DELIVER)
SSE, WEBSOCKET = "sse", "websocket"  # transports


def session_tag(session: str | None) -> str:
    """A short tag for a client's Codex session (thread) id, to tell concurrent sessions apart in the
    log and on the dashboard: four hex digits of its SHA-256 (the id itself is not shown). `-`
    without one."""
    if not session:
        return "-"
    return hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()[:4]


def usage_tokens(payload: object) -> dict[str, int] | None:
    """The token counts of a `response.completed` event's `response.usage` (input, output, total),
    or None when it carries none."""
    if not isinstance(payload, Mapping) or payload.get("type") != "response.completed":
        return None
    response = payload.get("response")
    usage = response.get("usage") if isinstance(response, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    out = {k: int(v) for k in ("input_tokens", "output_tokens", "total_tokens")
           if isinstance(v := usage.get(k), (int, float)) and not isinstance(v, bool) and v >= 0}
    return out or None


@dataclass(frozen=True)
class Try:
    credential: str
    verdict: str
    reason: str


@dataclass
class RequestRecord:
    """One model request (an HTTP request or a WebSocket turn) as the dashboard lists it."""

    request_id: str
    at: float  # wall clock at its start
    session: str  # session_tag
    model: str
    transport: str  # SSE or WEBSOCKET
    tries: list[Try] = field(default_factory=list)
    first_output_ms: int | None = None
    outcome: str | None = None  # an answer that was not an attempt's (exhausted, all cooling)
    tokens_from: Callable[[], dict[str, int] | None] | None = None  # the winner's response.completed usage

    @property
    def tokens(self) -> dict[str, int] | None:
        return self.tokens_from() if self.tokens_from is not None else None

    @property
    def served_by(self) -> str | None:
        return next((t.credential for t in reversed(self.tries) if t.verdict in _SERVED), None)

    @property
    def moved(self) -> bool:
        """Served by another credential than the one it was first sent to."""
        served = self.served_by
        return served is not None and bool(self.tries) and self.tries[0].credential != served


class Activity:
    """The ring of recent requests and the counts since start."""

    def __init__(self, size: int = RECENT) -> None:
        self.recent: deque[RequestRecord] = deque(maxlen=size)
        self.requests = 0
        self.served = 0
        self.moved = 0
        self.unserved = 0  # answered without an attempt serving it (exhausted, all cooling)
        self.rejections: Counter[str] = Counter()  # reason -> attempts that did not serve for it

    def start(self, request_id: str, at: float, session: str | None, model: object, transport: str) -> RequestRecord:
        record = RequestRecord(request_id, at, session_tag(session), model if isinstance(model, str) and model else "-",
                               transport)
        self.recent.append(record)
        self.requests += 1
        return record

    def attempt(self, record: RequestRecord, credential: str, verdict: str, reason: str) -> None:
        """An attempt's verdict. The first serving one counts the request served (and moved, when it
        was not the first credential tried); each one that did not serve counts its reason."""
        was_served = record.served_by is not None
        record.tries.append(Try(credential, str(verdict), reason))
        if verdict in _NOT_SERVED:
            self.rejections[reason] += 1
        elif verdict in _SERVED and not was_served:
            self.served += 1
            self.moved += record.moved

    def first_output(self, record: RequestRecord, ms: float) -> None:
        if record.first_output_ms is None:
            record.first_output_ms = max(0, int(ms))

    def answered(self, record: RequestRecord, outcome: str) -> None:
        """The request was answered by the proxy (nothing could serve it)."""
        if record.outcome is None and record.served_by is None:
            record.outcome = outcome
            self.unserved += 1

    def counts(self) -> dict[str, Any]:
        return {"requests": self.requests, "served": self.served, "moved_away": self.moved,
                "not_served": self.unserved, "rejections": dict(self.rejections.most_common())}
