"""What an attempt's event stream says, framed once: the bootstrap classifier's decision, the
rate-limit events, how the stream ended (for recovery) and the artifacts it carries (provenance).
Pure; used by the attempt's machine (attempt_machine.py)."""

from __future__ import annotations

from .attempt_events import Broke, Chunk, End, Event, Tick
from .classifier import BootstrapClassifier, Decision
from .framer import Event as SseEvent, FramerError
from .provenance import SseArtifacts
from .recovery import TerminalTracker, recoverable_stream_end
from .usage import Window, from_event
from .vocabulary import FRAMING_ERROR, UPSTREAM_BROKEN


class StreamView:
    def __init__(self, track_ending: bool):
        self.received = bytearray()  # every byte held, in order, until committed
        self.ended = False  # the whole body arrived
        self.error: str | None = None  # the upstream broke (what came is still delivered, then the break)
        self.made = SseArtifacts()  # frames the stream, and keeps its artifacts until taken
        self.tracker = TerminalTracker() if track_ending else None
        self.rest: list[SseEvent] = []  # the events framed with the deciding one, after it
        self.usage: list[list[Window]] = []  # the rate-limit windows seen, in order, for the machine to take

    def hold(self, clf: BootstrapClassifier, event: Event) -> Decision:
        """While the attempt is held: `event` kept, and what the classifier makes of it."""
        if isinstance(event, Tick):
            return clf.tick()
        if isinstance(event, Chunk):
            self.received += event.data
            return self.classify(clf, event.data)
        if isinstance(event, End):
            self.ended = True
            return self.classify(clf, None)
        if isinstance(event, Broke):  # deliver what came, then the break
            self.error = event.message
            return clf.fail_open(UPSTREAM_BROKEN)
        raise AssertionError(f"unexpected {event!r} while holding")

    def keep(self, event: Event, idle: float) -> None:
        """Recovery: `event` kept whole; only how the stream ends is looked at (`idle`: the Tick's)."""
        if isinstance(event, Tick):
            self.error = f"no data for {idle:g}s"
        elif isinstance(event, Chunk):
            self.received += event.data
            self.track(event.data)
        elif isinstance(event, End):
            self.ended = True
            self.track(None)
        elif isinstance(event, Broke):
            self.error = event.message

    def classify(self, clf: BootstrapClassifier, data: bytes | None) -> Decision:
        """Classify the events `data` completes (None: the stream's end) until a decision; the
        ending tracker sees all of them (a chunk may hold the deciding event and the end)."""
        # At the end, no tick first: a stream that closed with nothing is closed_before_output,
        # even just past the time budget (clf.end decides it).
        decision, tracker = (clf.tick() if data is not None else None), self.tracker
        try:
            events = self.made.frame(data)
        except FramerError:
            if data is None:  # the framer's bounds were broken already: nothing more to see
                events = []
            else:
                if tracker is not None:
                    tracker.unframed()
                return clf.fail_open(FRAMING_ERROR)
        for i, event in enumerate(events):
            if decision is None or not decision.final:
                decision = clf.feed(event)
                if decision.final:
                    self.rest = events[i + 1:]
                if event.type == "codex.rate_limits" and isinstance(payload := event.payload, dict):
                    self.usage.append(from_event(payload))  # parsed already by the classifier
            if tracker is not None:
                tracker.see(event)
        if decision is None or (data is None and not decision.final):
            return clf.end()  # (decision is None only at the end)
        return decision

    def track(self, data: bytes | None) -> None:
        """Frame `data` (None: the end) only to see how the stream ends."""
        assert self.tracker is not None, "the ending is tracked with recovery on"
        try:
            events = self.made.frame(data)
        except FramerError:  # framing stops (every later call says so too)
            self.tracker.unframed()
            return
        for event in events:
            self.tracker.see(event)

    def how_it_ended(self) -> str | None:
        """None: complete; else why recovery may retry it (recovery.recoverable_stream_end)."""
        assert self.tracker is not None, "the ending is tracked with recovery on"
        return recoverable_stream_end(self.tracker.terminal, self.tracker.error)
