"""The SSE hold: a streamed attempt's response, held from the client until the bootstrap classifier
decides (docs/architecture.md#the-hold-a-closed-allow-list), then committed: the held bytes and
the live rest go to the held client. With recovery on, the committed stream is kept whole first
(docs/recovery.md)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.classifier import FRAMING_ERROR, BootstrapClassifier, Decision, Verdict
from ..core.failover_loop import Rejection
from ..core.framer import FramerError
from ..core.provenance import SseArtifacts
from ..core.recovery import NO_TERMINAL, TRANSPORT, TerminalTracker, recoverable_stream_end
from ..core.run_log import AttemptEnd
from ..core.usage import from_event
from ..net.relay import UpstreamBroken
from .attempt import CHUNK, END, Attempt

if TYPE_CHECKING:
    from ..core.planner import Candidate
    from .request_run import RequestRun

log = logging.getLogger("codex_failover")


@dataclass
class StreamState:
    """What the hold has of the stream so far."""

    received: bytearray = field(default_factory=bytearray)  # every byte, in order, until committed
    ended: bool = False  # the whole body arrived
    error: str | None = None  # the upstream broke (what came is still delivered, then the break)


class SseHold:
    """One streamed attempt: hold, classify, then fail over, buffer (recovery) or commit."""

    def __init__(self, run: "RequestRun", attempt: Attempt, cand: "Candidate"):
        self.run, self.attempt, self.cand = run, attempt, cand
        self.state = StreamState()
        # Frames the stream once, for the classifier, the recovery tracker and the artifacts this
        # credential made (kept for requests that carry them back; taken only once committed).
        self.made = SseArtifacts()
        self.tracker = TerminalTracker() if run.pool.recovery.enabled else None

    async def run_hold(self) -> AttemptEnd:
        run, attempt, state = self.run, self.attempt, self.state
        clf = BootstrapClassifier(run.rules, timeout=run.pool.policy.bootstrap_timeout)
        decision: Decision | None = None
        while decision is None or not decision.final:
            item = await run.next_item(attempt, clf.deadline)
            if item is None:
                decision = clf.tick()
            elif item.kind == CHUNK:
                state.received += item.data
                decision = self._feed(clf, item.data)
            elif item.kind == END:
                state.ended = True
                decision = self._finish(clf)
            else:  # the upstream broke while we held: deliver what came, then the break
                state.error = item.data.decode(errors="replace")
                decision = clf.fail_open("upstream_broken")
        if decision.verdict is Verdict.FAILOVER:
            resp = attempt.flow.response
            rejection = Rejection(decision.reason, resp.status_code, dict(decision.error or {}),
                                  retry_after=resp.headers.get("retry-after"))
            run.reject(attempt, self.cand, rejection)
            await attempt.cancel()
            return AttemptEnd("rejected", rejection)
        slots, recovery = run.shared.recovery_slots, run.pool.recovery
        if recovery.enabled and slots.take(recovery.max_concurrent):
            try:
                return await self._buffer_whole(decision)
            finally:
                slots.give_back()
        self.deliver(decision)
        await run.client.first_output()  # the client's first output before the run's bookkeeping
        self.record(decision)
        return AttemptEnd("committed")

    async def _buffer_whole(self, decision: Decision) -> AttemptEnd:
        """Recovery: keep the committed stream until it ends. A complete (or finally failed) one is
        delivered whole; a transient failure asks for a retry. Past `max_buffer_bytes`, fail open:
        what is buffered goes out once, in order, and the rest streams live."""
        run, attempt, state = self.run, self.attempt, self.state
        limit = run.pool.recovery.max_buffer_bytes
        if run.pool.recovery.heartbeat and run.client.sink is None:
            run.client.start_heartbeat(run.pool.recovery.heartbeat)
            log.info("[%s] recovery: heartbeat every %gs while the response is buffered", run.request_id,
                     run.pool.recovery.heartbeat)
        idle = run.pool.policy.response_timeout
        while not state.ended and state.error is None:
            if len(state.received) > limit:
                log.info("[%s] recovery: response over %d bytes; streaming the rest live", run.request_id, limit)
                self.commit(decision)
                return AttemptEnd("committed")
            item = await run.next_item(attempt, time.monotonic() + idle)
            if item is None:
                state.error = f"no data for {idle:g}s"
            elif item.kind == CHUNK:
                state.received += item.data
                self._track(item.data)
            elif item.kind == END:
                state.ended = True
                self._track(None)
            else:
                state.error = item.data.decode(errors="replace")
        if state.error is not None:
            run.log.record(attempt, self.cand, "recover", TRANSPORT, 200)
            await attempt.cancel()
            return AttemptEnd("recover", message=f"transport error: {state.error}")
        why = recoverable_stream_end(self.tracker.terminal, self.tracker.error)
        if why is None:
            self.commit(decision)
            return AttemptEnd("committed")
        run.log.record(attempt, self.cand, "recover", why, 200)
        return AttemptEnd("recover", message=why, final=None if why == NO_TERMINAL else lambda: self.commit(decision))

    def commit(self, decision: Decision) -> None:
        self.deliver(decision)
        self.record(decision)

    def deliver(self, decision: Decision) -> None:
        """The winner: what was held, then the live rest, to the client."""
        run, attempt, state = self.run, self.attempt, self.state
        resp = attempt.flow.response
        held, committed, metrics = bytes(state.received), time.monotonic(), run.shared.metrics
        state.received = bytearray()
        made, cand = self.made, self.cand  # the held bytes were framed (and their artifacts found) as they came
        run.made(cand, made.take())

        async def body():
            if metrics is not None:  # the head and the held bytes (the first output) went out
                metrics.first_output_to_client_seconds(time.monotonic() - committed)
            if state.error is not None:
                raise UpstreamBroken(state.error)
            if state.ended:
                run.made(cand, made.close())
                return
            while True:
                item = await attempt.next_batch()
                if item.kind == CHUNK:
                    run.made(cand, made.feed(item.data))
                    yield item.data
                elif item.kind == END:
                    run.made(cand, made.close())
                    return
                else:
                    raise UpstreamBroken(item.data.decode(errors="replace"))

        run.winner = attempt
        run.client.stream(resp.status_code, resp.reason, list(resp.headers.fields), body, held)

    def record(self, decision: Decision) -> None:
        """The winner's verdict, in the pool and in the log."""
        self.run.succeeded(self.cand)
        self.run.log.record(self.attempt, self.cand, decision.verdict.value, decision.reason,
                            self.attempt.flow.response.status_code, ok=True)

    # -- framing ------------------------------------------------------------------------------

    def _feed(self, clf: BootstrapClassifier, data: bytes) -> Decision:
        """Classify the events of `data` until a decision; a recovery tracker sees all of them
        (a chunk may hold the deciding event and the stream's end)."""
        decision, tracker = clf.tick(), self.tracker
        try:
            events = self.made.frame(data)
        except FramerError:
            if tracker is not None:
                tracker.unframed()
            return clf.fail_open(FRAMING_ERROR)
        for event in events:
            if not decision.final:
                decision = clf.feed(event)
                if event.type == "codex.rate_limits":  # parsed already by the classifier
                    self.run.note_usage(self.cand, from_event(event.payload))
            if tracker is not None:
                tracker.see(event)
        return decision

    def _finish(self, clf: BootstrapClassifier) -> Decision:
        decision = None
        try:
            events = self.made.frame(None)
        except FramerError:  # the framer's bounds were broken already: nothing more to see
            events = []
        for event in events:
            if decision is None or not decision.final:
                decision = clf.feed(event)
            if self.tracker is not None:
                self.tracker.see(event)
        return decision if decision is not None and decision.final else clf.end()

    def _track(self, data: bytes | None) -> None:
        """Frame `data` (None: end of stream) only to see how the stream ends."""
        try:
            events = self.made.frame(data)
        except FramerError:  # framing stops (every later call says so too)
            self.tracker.unframed()
            return
        for event in events:
            self.tracker.see(event)
