"""What one request's attempts did: its history, each attempt's verdict on its flow (mitmweb's
mark, comment and error), the client flow's comment, the metrics and the log line per attempt.
Pure: the flows and the attempt are only written to; `shown` tells mitmweb (held_client.shown_changed)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import seen_clients, story
from .activity import Activity, RequestRecord
from .auth import AuthMaterial
from .planner import Candidate
from .story import AttemptLog
from .vocabulary import Verdict

log = logging.getLogger("codex_failover")
WHY = "docs/decisions.md#decisions-and-reason-classes"  # what each verdict= and reason= means
_explained = False  # the first attempt that failed over, failed or delivered says once where the reasons are explained


@dataclass
class RunLog:
    request_id: str
    flow: Any  # the client's flow (its comment tells the story)
    metrics: Any | None = None  # metrics.Metrics
    shown: Callable[[Any], None] = lambda flow: None  # (told the flow: mitmweb shows it anew)
    history: list[AttemptLog] = field(default_factory=list)
    skipped: dict[str, story.Skipped] = field(default_factory=dict)  # credential name -> story.Skipped, for the flow comment
    total: int = 0  # attempts planned for this request (for "attempt n/N")
    why_pinned: str | None = None
    client_auth: AuthMaterial | None = None  # the client's own credential (its metrics label)
    started: float = field(default_factory=time.monotonic)
    session: str = "-"  # the client's session tag (activity.session_tag), on each line
    activity: Activity | None = None  # the dashboard's recent requests and counts
    entry: RequestRecord | None = None  # this request's row there

    def record(self, attempt: Any, cand: Candidate, verdict: str, reason: str, status: int | None, ok: bool = False) -> None:
        n, total = attempt.n, self.total
        elapsed = int((time.monotonic() - attempt.started) * 1000)
        route = attempt.endpoint.label if attempt.endpoint else "direct"
        entry = AttemptLog(n, cand.name, verdict, reason, elapsed, status, route)
        self.history.append(entry)
        attempt.judge(story.mark(verdict, reason, ok), story.attempt_comment(self.request_id, entry, total),
                      None if ok else story.attempt_error(verdict, reason))
        if self.metrics is not None:
            own = self.client_auth if cand.is_client and cand.key.startswith("client:") else None
            self.metrics.attempt(seen_clients.label(own) if own is not None else cand.name, verdict, reason)
        if self.activity is not None and self.entry is not None:
            self.activity.attempt(self.entry, cand.name, verdict, reason)
        self.tell()
        log.info("[%s] attempt %d/%d credential=%s route=%s verdict=%s reason=%s status=%s elapsed=%dms session=%s",
                 self.request_id, n, total, cand.name, route.replace(" ", "="), verdict, reason, status, elapsed,
                 self.session)
        global _explained
        if not ok and not _explained and verdict != Verdict.CANCELLED:  # (a client that left: nothing to explain)
            _explained = True
            log.info("[%s] (why an attempt failed over, and what each verdict= and reason= means: %s)",
                     self.request_id, WHY)

    def cut(self, attempt: Any, cand: Candidate, reason: str, status: int | None) -> None:
        """The committed attempt's stream ended at a rejection after its output began
        (core/after_output.py): its line, history, metrics and the dashboard's count say so."""
        elapsed = int((time.monotonic() - attempt.started) * 1000)
        route = attempt.endpoint.label if attempt.endpoint else "direct"
        entry = AttemptLog(attempt.n, cand.name, Verdict.FAILOVER, reason, elapsed, status, route)
        self.history.append(entry)
        if self.metrics is not None:
            own = self.client_auth if cand.is_client and cand.key.startswith("client:") else None
            self.metrics.attempt(seen_clients.label(own) if own is not None else cand.name, Verdict.FAILOVER, reason)
        if self.activity is not None and self.entry is not None:
            self.activity.attempt(self.entry, cand.name, Verdict.FAILOVER, reason)
        self.tell("ended for a re-send")
        log.warning("[%s] attempt %d/%d credential=%s route=%s verdict=failover reason=%s status=%s elapsed=%dms "
                    "session=%s: rejected after its output began; the stream ends without response.completed, "
                    "so Codex re-sends the request", self.request_id, attempt.n, self.total, cand.name,
                    route.replace(" ", "="), reason, status, elapsed, self.session)

    def tell(self, outcome: str | None = None) -> None:
        """The client flow's comment: a summary line, then each attempt and each credential skipped."""
        self.flow.comment = story.request_comment(self.history, self.skipped, self.why_pinned, outcome,
                                                  self.request_id)
        self.shown(self.flow)

    def first_output(self) -> None:
        """The client's first output went out: the time since the request came, for the dashboard."""
        if self.activity is not None and self.entry is not None:
            self.activity.first_output(self.entry, (time.monotonic() - self.started) * 1000)

    def summary(self, what: str) -> None:
        if self.activity is not None and self.entry is not None:
            self.activity.answered(self.entry, what)
        self.tell(what)
        elapsed = int((time.monotonic() - self.started) * 1000)
        log.warning("[%s] %s after %d attempt(s), %dms session=%s", self.request_id, what, len(self.history), elapsed,
                    self.session)
