"""A committed response after its output began: one rule for both transports, and the released bytes
of an SSE stream. Pure (no mitmproxy, no I/O).

The rule (`AfterOutput`): a rejection the rules name (an overload, a limit) that arrives after the
output began is not delivered while no item of the response but reasoning has completed. The user has
seen deltas, not a whole message, and Codex has run no tool call of it: the response ends in a way
Codex retries (an SSE stream without `response.completed`; a WebSocket close it reconnects on), and
its re-send starts the answer over on a credential that can serve it, so the final answer is whole and
shown once. Once a whole item other than reasoning is out, a re-send would repeat it: the rejection is
delivered as it came. Cheap on a stream relayed live: only an event that may be an error, or an item's
end, is parsed.

`LiveSse` releases a committed SSE stream at event boundaries: the client gets each event whole
(a chunk that ends inside an event keeps that event's bytes until the rest comes), so the stream can
end cleanly before a rejection. Every byte released is a byte received, in order; if the framer's
bounds break, everything not yet released goes out as it came and nothing more is looked at.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from .classifier import Decision, stream_error
from .framer import Event, FramerError
from .provenance import SseArtifacts
from .rules import Rules
from .vocabulary import Verdict

_DONE = (b'"response.completed"', b'"response.incomplete"')
_ITEM_DONE = b'"response.output_item.done"'
_MAY_BE_ERROR = (b'"error"', b'"response.failed"')


class AfterOutput:
    """The rule above, fed a committed response's events in order (an SSE event, a WebSocket message)."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self.watching = True  # until the response completes or one rejection was seen
        self.whole_item = False  # an item other than reasoning completed: a re-send would repeat it

    def see(self, raw: bytes, payload: Callable[[], object]) -> Decision | None:
        """`raw`: the event's bytes; `payload`: its parsed JSON, asked only when needed. A decision
        (FAILOVER, the rejection's class) when the response is to end in a retry instead."""
        if not self.watching:
            return None
        if _DONE[0] in raw or _DONE[1] in raw:
            self.watching = False
            return None
        if _ITEM_DONE in raw:
            body = payload()
            item = body.get("item") if isinstance(body, dict) else None
            if not isinstance(item, dict) or item.get("type") != "reasoning":
                self.whole_item = True
            return None
        if _MAY_BE_ERROR[0] not in raw and _MAY_BE_ERROR[1] not in raw:
            return None
        body = payload()
        if not isinstance(body, dict) or body.get("type") not in ("error", "response.failed"):
            return None
        self.watching = False
        error = stream_error(body)
        klass = self.rules.rejection_class(error.get("code"), error.get("type"), error.get("message"), error.get("status"))
        if klass is None or self.whole_item:
            return None  # not a rejection, or the user has a whole item already: delivered as sent
        return Decision(Verdict.FAILOVER, klass, body.get("type"), error)


@dataclass(frozen=True)
class Released:
    """What a committed SSE stream's next bytes come to: `out` for the client now, and `cut` when the
    stream is to end here instead (the rejection after output; nothing after it goes out)."""

    out: bytes
    cut: Decision | None = None


class LiveSse:
    """A committed SSE stream's bytes, released at event boundaries (see the module's docstring).
    `made` frames the stream once for provenance as well; `rule` is None when nothing is cut (recovery
    keeps its own rule)."""

    def __init__(self, made: SseArtifacts, rule: AfterOutput | None):
        self.made, self.rule = made, rule
        self.unsent = b""  # bytes received and framed into no whole event yet
        self.framed = True  # False once the framer's bounds broke: bytes pass as they come
        self.cut = False  # the stream ended at a rejection: nothing more is released

    def held(self, received: bytes) -> bytes:
        """At the commit: of the held bytes (`received`, all framed already), the whole events."""
        pending = self.made.pending if self.framed else 0
        if pending == 0:
            return received
        self.unsent = received[len(received) - pending:]
        return received[:len(received) - pending]

    def feed(self, data: bytes | None) -> Released:
        """The stream's next bytes (None: its end)."""
        if self.cut:
            return Released(b"")
        if not self.framed:
            return Released(data or b"")
        try:
            events = self.made.frame(data)
        except FramerError:  # the bounds broke: what was kept back goes out with this, unlooked at
            self.framed = False
            out, self.unsent = self.unsent + (data or b""), b""
            return Released(out)
        rule = self.rule
        if rule is not None and rule.watching:
            for i, event in enumerate(events):
                decision = rule.see(event.raw, _payload_of(event))
                if decision is not None:
                    self.cut = True
                    self.unsent = b""
                    return Released(b"".join(e.raw for e in events[:i]), decision)
        pending = self.made.pending
        if not self.unsent and pending == 0:
            return Released(data or b"")  # the usual case: a read that ends on an event's end
        whole = self.unsent + (data or b"")
        cut = len(whole) - pending
        self.unsent = whole[cut:]
        return Released(whole[:cut])


def cut_off(headers: Container[str]) -> bool:
    """How a stream cut before a rejection ends for its client: as a stream ends (HTTP/1.1's last
    chunk, HTTP/2's END_STREAM), unless its body has a stated length (its client would wait for the
    rest): then it is cut off (reset) instead. `headers`: the response's (case-insensitive)."""
    return "content-length" in headers


def _payload_of(event: Event) -> Callable[[], object]:
    return lambda: event.payload
