"""One attempt of a held request, sans-I/O: what its response head, chunks, end, errors and
silences mean, in h11's manner. Events in (`Head`, `Chunk`, `End`, `Broke`, `Tick`, `Whole`),
commands out (`ReadWhole`, `Cancel`, `Commit`, `Respond`, `Heartbeat`, `Record`); when it is over,
`result` is what the failover loop is told (Served, Rejected, Transient).

It decides everything about one attempt that the shell used to: the deadlines of the head
(connect_timeout, response_timeout), the SSE hold (bootstrap classifier, framing), whether a
rejection cools its credential (`outcomes.cools`, and nothing else), recovery's buffering
(docs/recovery.md), a whole answer's verdict (taxonomy), and what the pool and provenance learn.
The shell reads bytes by `deadline` (its clock, injected here as `clock`), feeds them in, and carries
out the commands in order. No mitmproxy, no asyncio; docs/architecture.md#the-request-machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from .after_output import AfterOutput, LiveSse, Released
from .attempt_events import (
    Broke,
    Cancel,
    Command,
    Commit,
    Event,
    Head,
    Heartbeat,
    ReadWhole,
    Record,
    Respond,
    Scope,
    Succeeded,
    Tick,
    Whole,
)
from .classifier import BootstrapClassifier, Decision
from .outcomes import SERVED, Rejected, Rejection, Result, Transient, cools, own_refusal
from .planner import Candidate
from .policy import Policy
from .provenance import artifacts_of_compact
from .recovery import RECOVERABLE_STATUS
from .routes import Endpoint
from .rules import Rules
from .stream_view import StreamView
from .taxonomy import answer_headers, classify_response
from .transport import classify_connection_error
from .usage import Window, from_headers
from .vocabulary import (
    CLIENT_GONE,
    HOST_NETWORK,
    INCOMPLETE_RESPONSE,
    MODEL_NOT_ENTITLED,
    NO_TERMINAL,
    PRE_DISPATCH,
    RESPONSE_TIMEOUT,
    TLS_FAILED,
    TRANSPORT,
    Verdict,
)

EXTENDED_HEARTBEAT = 15.0  # seconds between keepalives in an extended hold when recovery's heartbeat is off
HEAD, HOLD, BUFFER, WHOLE, OVER = "reading the head", "holding the stream", "buffering", "reading whole", "over"  # phases
RESPOND_IT, COMMIT_IT = "respond with it", "commit it"  # a Transient's `final`: how its attempt answers at the end


@dataclass
class HeadDeadlines:
    """When waiting for the response head ends: `connect_timeout` for the connection, then
    `response_timeout` for the answer, each held on its own from the attempt's start."""

    connect_by: float | None
    answer_by: float

    @classmethod
    def starting(cls, policy: Policy, now: float) -> HeadDeadlines:
        answer_by = now + policy.response_timeout
        return cls(min(now + policy.connect_timeout, answer_by), answer_by)

    @property
    def next(self) -> float:
        return self.connect_by if self.connect_by is not None else self.answer_by

    def passed(self, now: float) -> bool:
        """The deadline in force passed on a connection that is up: is waiting over? Not while it
        still has time to answer (the response deadline is then in force)."""
        if self.connect_by is not None and now < self.answer_by:
            self.connect_by = None
            return False
        return True


@dataclass
class AttemptMachine:
    """One attempt (see the module's docstring)."""

    scope: Scope
    cand: Candidate
    endpoint: Endpoint | None = None
    phase: str = HEAD
    result: Result | None = None  # set once the phase is OVER
    reported: bool = False  # the result was told to the failover loop
    status: int = 0
    retry_after: str | None = None
    headers: Mapping[str, str] | None = None  # the answer's head (a rule may read a header)
    verdict: Decision | None = None  # the classifier's, once it decided

    def __post_init__(self) -> None:
        self._deadline: float | None = None
        self.start()  # (again by the shell, once the attempt left)
        self.view = StreamView(self.scope.pool.recovery.enabled)  # frames the stream once
        self._clf: BootstrapClassifier | None = None
        self._slot = False
        self._rejection: Rejection | None = None  # a recoverable whole answer, as a rejection
        self._kept_alive = False  # an extended hold asked for the heartbeat
        self.released = LiveSse(self.view.made, None)  # once committed: what the client gets of each chunk
        self.late: Rejection | None = None  # a rejection after the output began, which ended the stream

    @property
    def over(self) -> bool:
        return self.phase == OVER

    @property
    def deadline(self) -> float | None:
        """When the shell feeds `Tick` if nothing came (its clock); None: no deadline."""
        return self._deadline

    def send(self, event: Event) -> list[Command]:
        assert not self.over, f"attempt over, got {event!r}"
        if self.phase == HEAD:
            return self._head(event)
        if self.phase == HOLD:
            return self._hold(event)
        if self.phase == BUFFER:
            return self._buffer(event)
        return self._whole(event)

    def start(self) -> None:
        """The attempt left (the shell started it): its connect and response deadlines run from now."""
        self.head = HeadDeadlines.starting(self.scope.pool.policy, self.scope.clock())
        self._deadline = self.head.next

    def succeeded(self) -> None:
        """Carried out for `Succeeded`: the credential is well and the session's home (pool_feedback).
        Not after a cut: the shell carries out a commit's commands once the client's first output went
        out, and the live rest may meet a rejection after the output before that (`live`); what it
        taught the pool stands."""
        if self.late is None:
            self.scope.feedback.succeeded(self.cand.key, self.scope.session, self.scope.model)

    def abandon(self) -> None:
        """The shell gave up on the attempt (a bug, a cancel): its recovery slot goes back. Idempotent."""
        self._give_back()
        if self.phase != OVER:
            self.phase, self._deadline = OVER, None

    def client_gone(self) -> list[Command]:
        """The client left: the attempt is cancelled and recorded so."""
        self.abandon()
        return [Record(Verdict.CANCELLED, CLIENT_GONE, None), Cancel()]

    def live(self, data: bytes | None) -> Released:
        """A chunk of a committed stream's live rest (None: its end): what the client gets of it now
        (whole events), the artifacts it made, and whether the stream ends here instead: a rejection
        after the output began (core/after_output.py), which cools its credential as any rejection
        does, so Codex's re-send of the request moves."""
        released = self.released.feed(data)
        self._made(self.view.made.take())
        cut = released.cut
        if cut is not None and self.late is None:
            self.late = Rejection(cut.reason, self.status, dict(cut.error or {}))
            learn(self.scope, self.cand, self.late)
        return released

    # -- the head ------------------------------------------------------------------------------

    def _head(self, event: Event) -> list[Command]:
        policy = self.scope.pool.policy
        if isinstance(event, Tick):
            if not event.connected:  # never connected: not one request byte left, so it may move
                waited = min(policy.connect_timeout, policy.response_timeout)
                return self._failed_to_connect(f"timed out connecting after {waited:g}s") + [Cancel()]
            if not self.head.passed(self.scope.clock()):
                self._deadline = self.head.next
                return []
            message = f"no response from upstream within {policy.response_timeout:g}s"
            return self._over_rejected(Rejection(RESPONSE_TIMEOUT, None, {"message": message}),
                                       [Record(Verdict.FAILED, RESPONSE_TIMEOUT, None), Cancel()])
        if isinstance(event, Broke):
            return self._failed_to_connect(event.message)
        assert isinstance(event, Head), f"expected the head, got {event!r}"
        self.status, self.retry_after = event.status, event.headers.get("retry-after")
        self.headers = event.headers
        health = self.scope.feedback.health
        self._usage(from_headers(event.headers, health.now()))
        if event.streaming:
            self.phase = HOLD
            self._clf = hold_classifier(self.scope.rules, policy, self.scope.clock)
            self._deadline = self._clf.deadline
            return []
        self.phase = WHOLE
        self._deadline = self.scope.clock() + policy.response_timeout
        return [ReadWhole()]

    def _failed_to_connect(self, message: str) -> list[Command]:
        """Before any response: only a failure proven to precede dispatch may move
        (docs/architecture.md#replay-safety); the failover loop decides."""
        kind = classify_connection_error(message, response_started=False)
        if kind == TLS_FAILED:
            self.scope.tell(logging.ERROR, f"TLS verification to the upstream failed for credential {self.cand.name}: "
                                         f"{message} (not retried elsewhere)")
        # Host-wide network loss names the endpoint it came through (a pre-dispatch failure on an
        # endpoint is the route's: the loop names the endpoint in its route_down message).
        where = f"{self.endpoint.label}: " if self.endpoint and kind == HOST_NETWORK else ""
        status = 502 if kind in (PRE_DISPATCH, HOST_NETWORK) else None
        return self._over_rejected(Rejection(kind, status, {"message": where + message}),
                                   [Record(Verdict.FAILED, kind, None)])

    # -- the SSE hold ------------------------------------------------------------------------

    def _hold(self, event: Event) -> list[Command]:
        clf = self._clf
        assert clf is not None
        decision = self.view.hold(clf, event)
        for windows in self.view.usage:  # (what the view saw goes out; it keeps no way back to the machine)
            self._usage(windows)
        self.view.usage.clear()
        self._deadline = clf.deadline
        if not decision.final:
            if clf.extended and not self._kept_alive:  # held past bootstrap_timeout: Codex is kept alive
                self._kept_alive = True
                return [Heartbeat(self.scope.pool.recovery.heartbeat or EXTENDED_HEARTBEAT)]
            return []
        if decision.verdict is Verdict.COMMIT and self.view.tracker is None:  # (recovery keeps its own rule)
            decision = self._after_output(decision)
        self.verdict = decision
        if decision.verdict is Verdict.FAILOVER:
            rejection = Rejection(decision.reason, self.status, dict(decision.error or {}), retry_after=self.retry_after)
            return self._reject(rejection) + [Cancel()]
        recovery = self.scope.pool.recovery
        if recovery.enabled and self.scope.slots.take(recovery.max_concurrent):
            self._slot, self.phase = True, BUFFER
            out: list[Command] = [Heartbeat(recovery.heartbeat)] if recovery.heartbeat else []
            return out + self._buffer_check()
        return self._commit()

    def _after_output(self, decision: Decision) -> Decision:
        """The output begins: what came with its first event, after it, is what a committed stream's
        rest would be (core/after_output.py); a rejection there is seen before anything went out."""
        rule = self.released.rule = AfterOutput(self.scope.rules)
        rest, self.view.rest = self.view.rest, []
        for event in rest:
            late = rule.see(event.raw, partial(getattr, event, "payload"))
            if late is not None:
                return late
        return decision

    # -- recovery: the committed stream kept whole (docs/recovery.md) -----------------------------

    def _buffer(self, event: Event) -> list[Command]:
        self.view.keep(event, self.scope.pool.policy.response_timeout)
        return self._buffer_check()

    def _buffer_check(self) -> list[Command]:
        """A complete (or finally failed) stream is delivered whole; a transient failure asks for a
        retry. Past `max_buffer_bytes`, fail open: what is buffered goes out once, the rest live."""
        if not self.view.ended and self.view.error is None:
            if len(self.view.received) > self.scope.pool.recovery.max_buffer_bytes:
                self.scope.tell(logging.INFO, f"recovery: response over {self.scope.pool.recovery.max_buffer_bytes} "
                                            f"bytes; streaming the rest live")
                return self._commit(first=False)
            self._deadline = self.scope.clock() + self.scope.pool.policy.response_timeout
            return []
        if self.view.error is not None:
            return self._over_transient(f"transport error: {self.view.error}", [Record(Verdict.RECOVER, TRANSPORT, 200), Cancel()],
                                       None)
        why = self.view.how_it_ended()
        if why is None:
            return self._commit(first=False)
        # A stream that ended in a terminal error is, should no retry be left, delivered as it came.
        return self._over_transient(why, [Record(Verdict.RECOVER, why, 200)], None if why == NO_TERMINAL else COMMIT_IT)

    # -- a whole answer ------------------------------------------------------------------------

    def _whole(self, event: Event) -> list[Command]:
        if isinstance(event, Tick | Broke) or (isinstance(event, Whole) and event.content is None):
            message = {"message": "upstream response did not complete"}
            return self._over_rejected(Rejection(INCOMPLETE_RESPONSE, None, message),
                                       [Record(Verdict.FAILED, INCOMPLETE_RESPONSE, None), Cancel()])
        assert isinstance(event, Whole) and event.content is not None, f"expected the whole body, got {event!r}"
        status, content = self.status, event.content
        verdict = classify_response(status, content, self.scope.rules, answer_headers(self.headers or {}))
        recovery = self.scope.pool.recovery
        if recovery.enabled and status in RECOVERABLE_STATUS and not names_a_rejection(self.scope.rules, verdict.error):
            if verdict.verdict == Verdict.FAILOVER:  # (a 408 is the client's: nothing to learn)
                self._rejection = Rejection(verdict.reason, status, dict(verdict.error or {}), retry_after=self.retry_after)
            return self._over_transient(f"HTTP {status}", [Record(Verdict.RECOVER, f"status_{status}", status)], RESPOND_IT)
        own = own_refusal(verdict.reason, self.cand)
        if verdict.verdict == Verdict.FAILOVER and not own:
            return self._reject(Rejection(verdict.reason, status, dict(verdict.error or {}), retry_after=self.retry_after))
        # Success without a stream, another 4xx, or the client's own 401/403: as is.
        if 200 <= status < 300 and self.scope.compact:
            self._made(artifacts_of_compact(content))
        if own:
            self.scope.feedback.client_refused(self.scope.client_auth)
        self._over(SERVED)
        return [Respond(), Succeeded(), Record(Verdict.DELIVER, verdict.reason, status, ok=True)]

    # -- endings -------------------------------------------------------------------------------

    def _commit(self, first: bool = True) -> list[Command]:
        commands = self._commit_bookkeeping(Commit(bytes(self.view.received), self.view.ended, self.view.error, first))
        self._over(SERVED)
        return commands

    def _commit_bookkeeping(self, commit: Commit) -> list[Command]:
        """What a commit teaches: the held bytes' artifacts (framed as they came), the success."""
        self.view.received = bytearray()
        self._made(self.view.made.take())
        if commit.ended:
            self._made(self.view.made.close())
        # The client gets whole events: the start of one still coming waits for its rest (`live`).
        commit = replace(commit, held=self.released.held(commit.held))
        decision = self.verdict
        assert decision is not None
        return [commit, Succeeded(), Record(decision.verdict, decision.reason, self.status, ok=True)]

    def _reject(self, rejection: Rejection) -> list[Command]:
        learn(self.scope, self.cand, rejection)
        return self._over_rejected(rejection, [Record(Verdict.FAILOVER, rejection.reason, rejection.status)])

    def _over_rejected(self, rejection: Rejection, commands: list[Command]) -> list[Command]:
        self._over(Rejected(rejection))
        return commands

    def _over_transient(self, why: str, commands: list[Command], final: str | None) -> list[Command]:
        self._over(Transient(why, final))
        return commands

    def give_up(self, final: object) -> list[Command]:
        """Recovery's retries ran out on this (the last) attempt: its own answer, as `final` (the
        Transient's) says, or nothing (the shell answers with recovery_exhausted). A whole answer
        teaches the pool what the same answer does without recovery (`learn`): a bare 5xx and a
        408 nothing, a 503 the rules class as an overload what an overload does."""
        if final == RESPOND_IT:
            if self._rejection is not None:
                learn(self.scope, self.cand, self._rejection)
            return [Respond()]
        if final == COMMIT_IT:
            return self._commit_bookkeeping(Commit(bytes(self.view.received), True, None, False))
        return []

    def _over(self, result: Result) -> None:
        self._give_back()
        self.result, self.phase, self._deadline = result, OVER, None

    def _give_back(self) -> None:
        if self._slot:
            self._slot = False
            self.scope.slots.give_back()

    def _usage(self, windows: list[Window]) -> None:
        self.scope.feedback.usage_seen(self.cand.key, self.cand.name, windows, self.scope.pool.policy, self.scope.where,
                                     self.cand.full_at)

    def _made(self, artifacts: list[str]) -> None:
        if artifacts:
            self.scope.provenance.record(artifacts, self.cand.key)


def hold_classifier(rules: Rules, policy: Policy, clock: Callable[[], float]) -> BootstrapClassifier:
    """The classifier of a held stream (an HTTP attempt's, a WebSocket turn's), with the policy's
    time bounds: bootstrap_timeout, then first_event_timeout and max_hold (classifier.py)."""
    return BootstrapClassifier(rules, timeout=policy.bootstrap_timeout, clock=clock,
                               stall=policy.first_event_timeout, max_hold=policy.max_hold)


def learn(scope: Scope, cand: Candidate, rejection: Rejection) -> None:
    """What a rejection teaches the pool: the one rule, for HTTP attempts and WebSocket turns alike.
    It cools (or takes out) its credential only when `cools` says so; for how long is taxonomy's."""
    if rejection.reason == MODEL_NOT_ENTITLED:
        scope.feedback.not_entitled(cand.key, cand.name, scope.model, scope.where)
    if cools(cand, rejection):
        scope.feedback.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                              rejection.retry_after, scope.pool.policy, scope.where)


def names_a_rejection(rules: Rules, error: Mapping[str, Any] | None) -> bool:
    """Does an error body itself name a rejection (overload, limits)? Those fail over; a bare
    transient status is recovery's to retry."""
    error = error or {}
    return rules.rejection_class(error.get("code"), error.get("type"), error.get("message")) is not None
