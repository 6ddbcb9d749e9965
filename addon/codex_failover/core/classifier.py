"""The bootstrap classifier: a sans-I/O state machine from events to a hold/release decision.

While the window is open, events that carry no output (the closed allow-list: docs/architecture.md#the-hold-a-closed-allow-list) are held.
The first event that is not on the list decides:
- a recognised rejection  -> FAILOVER (nothing held is released; the attempt is dropped);
- another terminal error   -> DELIVER  (release everything; the client sees the error in-stream);
- anything else            -> COMMIT   (release everything held, in order, then pass through).
Budgets (frames, bytes) are checked before an event is admitted. Time, on the next `feed()` or
`tick()` (the clock is injected, so tests never sleep):
- `timeout` (bootstrap_timeout) passed: commit (`timeout`), unless `stall` is set: then the hold is
  EXTENDED (nothing Codex would show has come: a rejection may still, late), and goes on
- until the upstream is silent for `stall` seconds (first_event_timeout, counted from its last event
  or keepalive): FAILOVER (`stalled_before_output`: a silent upstream moves),
- or until `max_hold` from the start: commit (`timeout`), as at the budget before.
docs/decisions.md#a-hold-that-outlasts-a-slow-rejection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .framer import Event
from .rules import Rules
from .vocabulary import (
    BYTE_BUDGET,
    CLOSED_BEFORE_OUTPUT,
    FRAME_BUDGET,
    HOLDING,
    INCOMPLETE,
    NOT_JSON,
    OUTPUT,
    STALLED_BEFORE_OUTPUT,
    TERMINAL_ERROR,
    TIMEOUT,
    Verdict,
)

# Reason classes outside the rules file's rejection classes. Stable: documented in docs/decisions.md.


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str
    trigger: str | None = None
    error: Mapping[str, Any] | None = None  # the upstream error object, for FAILOVER and DELIVER
    release: tuple[Event, ...] = ()  # events to pass to the client now, in order

    @property
    def final(self) -> bool:
        return self.verdict is not Verdict.HOLD


_HOLD = Decision(Verdict.HOLD, HOLDING)


class BootstrapClassifier:
    def __init__(
        self,
        rules: Rules,
        *,
        timeout: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        max_frames: int | None = None,
        max_bytes: int | None = None,
        stall: float = 0.0,
        max_hold: float = 0.0,
    ):
        self.rules = rules
        self.max_frames = max_frames if max_frames is not None else rules.max_frames
        self.max_bytes = max_bytes if max_bytes is not None else rules.max_bytes
        self._clock = clock
        started = clock()
        self._budget = started + timeout if timeout > 0 else None
        self._stall = stall
        # Extended past the budget only when both bounds make sense: a stall bound, and a cap beyond it.
        self._cap = started + max_hold if self._budget is not None and stall > 0 and max_hold > timeout else None
        self.last_seen = started  # the last event (a keepalive too): the stall counts from it
        self.extended = False  # past the budget with nothing shown: held on (the shell keeps the client alive)
        self.held: list[Event] = []
        self.held_frames = 0
        self.held_bytes = 0
        self.events_seen = 0
        self.decision: Decision | None = None

    # -- inputs ----------------------------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        """When `tick()` has something to decide (None: never)."""
        if self._budget is None or not self.extended:
            return self._budget
        assert self._cap is not None
        return min(self.last_seen + self._stall, self._cap)

    def feed(self, event: Event) -> Decision:
        self.events_seen += 1
        if self.decision is not None:
            passthrough = (event,) if self.decision.verdict is not Verdict.FAILOVER else ()
            return _replace_release(self.decision, passthrough)
        self.last_seen = self._clock()
        timed = self._timed(event)
        if timed is not None:
            return timed
        if self.held_frames + event.frames > self.max_frames:
            return self._decide(Verdict.COMMIT, FRAME_BUDGET, event.type, None, event)
        if self.held_bytes + len(event.raw) > self.max_bytes:
            return self._decide(Verdict.COMMIT, BYTE_BUDGET, event.type, None, event)
        verdict, reason, error = self._judge(event)
        if verdict is Verdict.HOLD:
            self.held.append(event)
            self.held_frames += event.frames
            self.held_bytes += len(event.raw)
            return _HOLD
        return self._decide(verdict, reason, event.type, error, event)

    def tick(self) -> Decision:
        """Time passed: commits what is held once the time budget has expired."""
        if self.decision is not None:
            return _replace_release(self.decision, ())
        return self._timed(None) or _HOLD

    def end(self) -> Decision:
        """The upstream closed the stream. Inside the window, nothing useful came: fail over."""
        if self.decision is not None:
            return _replace_release(self.decision, ())
        return self._decide(Verdict.FAILOVER, CLOSED_BEFORE_OUTPUT, None, None, None)

    def fail_open(self, reason: str) -> Decision:
        """The shell cannot observe the stream any more (e.g. a framing error): commit."""
        if self.decision is not None:
            return _replace_release(self.decision, ())
        return self._decide(Verdict.COMMIT, reason, None, None, None)

    @property
    def holding(self) -> bool:
        return self.decision is None

    # -- internals -------------------------------------------------------------------------

    def _timed(self, event: Event | None) -> Decision | None:
        """What time has decided (see the module's docstring), or None: hold on."""
        if self._budget is None:
            return None
        now = self._clock()
        if not self.extended:
            if now < self._budget:
                return None
            if self._cap is None:
                return self._decide(Verdict.COMMIT, TIMEOUT, None, None, event)
            self.extended = True
        assert self._cap is not None
        if now >= self._cap:
            return self._decide(Verdict.COMMIT, TIMEOUT, None, None, event)
        if now >= self.last_seen + self._stall:
            error = {"message": f"codex-failover: the upstream sent nothing for {self._stall:g}s before any output"}
            return self._decide(Verdict.FAILOVER, STALLED_BEFORE_OUTPUT, None, error, None)
        return None

    def _decide(self, verdict: Verdict, reason: str, trigger: str | None, error: Mapping[str, Any] | None,
                event: Event | None) -> Decision:
        if verdict is Verdict.FAILOVER:
            release: tuple[Event, ...] = ()
        else:
            release = tuple(self.held) + ((event,) if event is not None else ())
        self.held = []
        self.decision = Decision(verdict, reason, trigger, error, release)
        return self.decision

    def _judge(self, event: Event) -> tuple[Verdict, str, Mapping[str, Any] | None]:
        if event.is_heartbeat:
            return Verdict.HOLD, HOLDING, None
        payload = event.payload
        if not isinstance(payload, dict):
            return Verdict.COMMIT, NOT_JSON, None
        kind = payload.get("type")
        if kind in self.rules.bufferable_events:
            return Verdict.HOLD, HOLDING, None
        if kind == "response.output_item.added":
            return (Verdict.HOLD, HOLDING, None) if self._empty_item(payload.get("item")) else (Verdict.COMMIT, OUTPUT, None)
        if kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            return (Verdict.HOLD, HOLDING, None) if self._empty_part(payload.get("part")) else (Verdict.COMMIT, OUTPUT, None)
        if kind in ("error", "response.failed"):
            error = stream_error(payload)
            wrapped = payload.get("headers")
            klass = self.rules.rejection_class(
                error.get("code"), error.get("type"), error.get("message"), error.get("status"),
                param=error.get("param"), headers=_lower_keys(wrapped) if isinstance(wrapped, dict) else None,
            )
            if klass:
                return Verdict.FAILOVER, klass, error
            return Verdict.DELIVER, TERMINAL_ERROR, error
        if kind == "response.incomplete":
            return Verdict.DELIVER, INCOMPLETE, None
        return Verdict.COMMIT, OUTPUT, None

    def _empty_item(self, item: object) -> bool:
        if not isinstance(item, dict) or item.get("type") not in self.rules.empty_items:
            return False
        kind = item["type"]
        if kind == "message":
            content = item.get("content") or []
            return isinstance(content, list) and all(self._empty_part(part) for part in content)
        if kind == "reasoning":
            return not item.get("encrypted_content") and not item.get("summary") and not item.get("content")
        if kind == "function_call":
            return bool(item.get("arguments", "") == "")
        if kind == "custom_tool_call":
            return bool(item.get("input", "") == "")
        return False

    def _empty_part(self, part: object) -> bool:
        if not isinstance(part, dict) or part.get("type") not in self.rules.empty_parts:
            return False
        field = "refusal" if part["type"] == "refusal" else "text"
        return bool(part.get(field, "") == "")


def stream_error(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The error object of an `error` event or of `response.failed`, read where Codex reads it: under
    `response` (`response.error`), at the event's top level (`error`), or flat (code and message on the
    event itself, an `error` event only); a WebSocket-wrapped error's `status` or `status_code` is kept
    as `status`. Always a dict."""
    response = payload.get("response")
    found = response.get("error") if isinstance(response, dict) else None
    if not isinstance(found, dict):
        nested = payload.get("error")
        if isinstance(nested, dict):
            found = nested
        elif isinstance(nested, str):
            found = {"message": nested}
        elif payload.get("type") != "response.failed":
            found = _flat_error(payload)
    error = dict(found) if isinstance(found, dict) else {}
    for name in ("status", "status_code"):
        status = payload.get(name)
        if isinstance(status, int) and not isinstance(status, bool):
            error.setdefault("status", status)
            break
    return error


def _flat_error(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A flat `error` event carries code/message at top level; its `type` is the event's."""
    return {k: v for k, v in payload.items() if k not in ("type", "sequence_number", "status", "status_code", "headers",
                                                          "response")}


def _lower_keys(headers: Mapping[Any, Any]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in headers.items()}


def _replace_release(decision: Decision, release: tuple[Event, ...]) -> Decision:
    return Decision(decision.verdict, decision.reason, decision.trigger, decision.error, release)
