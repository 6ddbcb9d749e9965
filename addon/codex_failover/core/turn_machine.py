"""One gated WebSocket turn, sans-I/O: what a turn's verdict means for the gate, by the same rules
as an HTTP request (core/request_machine.py, core/failover_loop.py), in named states and one
transition table. The shell (ws/gate.py) carries out each state; it decides nothing.

    HELD ──served──────────────────────────▶ SERVED
      │──the client's own 401/403, or no turn▶ DELIVERED    the rejection as upstream sent it
      │──its socket lost the turn's state────▶ RECONNECTING Codex's re-send carries the full input
      │──a model nobody was seen serving─────▶ DELIVERED    the service's answer (entitlement.py)
      │──self-contained──────────────────────▶ MOVING       the turn's failover loop picks the next
      │                                                     socket: another credential, or the only
      │                                                     one after its backoff, or one back within
      │                                                     cooldown_wait (the loop waits, as on HTTP)
      │──continued, another credential ready─▶ RECONNECTING close the client with 1012: Codex re-sends
      │                                                     the full request on a new socket
      │──continued, a backoff left───────────▶ RESENDING    the same create on the same socket, later
      └──continued, nothing left─────────────▶ RECONNECTING
    MOVING ──opened──▶ HELD          MOVING ──none opened──▶ RECONNECTING
    RESENDING ──resent──▶ HELD       RESENDING ──socket gone──▶ RECONNECTING
    SERVED ──a rejection after output began──▶ RECONNECTING   the credential cools; Codex's re-send of
                                                             the whole request goes elsewhere and
                                                             starts the answer over

Nothing that another credential, or the same one a moment later, could serve reaches Codex as a
terminal error: when the turn is truly exhausted, the client socket closes with RECONNECT_CLOSE,
Codex reconnects, and the upgrade finds a credential back (the turn is served there) or none (426:
Codex re-sends over HTTP, where the HTTP path's exhausted answer, with its time, applies).
docs/websocket.md#when-a-turn-is-rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .attempt_events import Scope
from .attempt_machine import learn
from .failover_loop import backoff_delay
from .outcomes import Rejection, own_refusal
from .planner import Candidate
from .usage import Window
from .vocabulary import MODEL_NOT_ENTITLED, NO_USABLE_CREDENTIAL, STATE_LOST

# Codex treats a socket that closes during a turn as a transport error: it reconnects and sends the
# full request on a new socket, silently (verified with Codex 0.169 and 0.171, tests/test_codex_cli.py).
RECONNECT_CLOSE = 1012  # "service restart"
INTERNAL_CLOSE = 1011  # the upstream vanished, or the gate failed: a transport error for Codex too
NORMAL_CLOSE = 1000
ABNORMAL = 1006  # no close frame came (never sent on the wire)


class TurnState(Enum):
    HELD = "held"  # the turn's window is open on its socket
    SERVED = "served"
    DELIVERED = "delivered"  # its rejection went to Codex as upstream sent it
    MOVING = "moving"  # the turn's failover loop opens its next socket (it may wait first)
    RESENDING = "resending"  # the same create on the same socket after `delay`
    RECONNECTING = "reconnecting"  # the client socket closes with RECONNECT_CLOSE


class TurnEvent(Enum):
    SERVED = "served"
    OWN_REFUSAL = "the client's own credential refused"
    STATE_LOST = "its socket lost the state it continues"
    NO_SUCH_MODEL = "a model nobody was seen serving, refused by enough accounts"
    NO_TURN = "a rejection outside any turn"
    SELF_CONTAINED = "rejected, self-contained"
    OTHERS_READY = "rejected, continued, another credential ready"
    BACKOFF_LEFT = "rejected, continued, a backoff left"
    NOTHING_LEFT = "rejected, continued, nothing left"
    OPENED = "the next socket opened"
    NONE_OPENED = "no socket opened"
    RESENT = "resent"
    SOCKET_GONE = "the socket closed meanwhile"
    AFTER_OUTPUT = "rejected after its output began"


S, E = TurnState, TurnEvent
TRANSITIONS: dict[tuple[TurnState, TurnEvent], TurnState] = {
    (S.HELD, E.SERVED): S.SERVED,
    (S.HELD, E.OWN_REFUSAL): S.DELIVERED,
    (S.HELD, E.NO_TURN): S.DELIVERED,
    (S.HELD, E.STATE_LOST): S.RECONNECTING,
    (S.HELD, E.NO_SUCH_MODEL): S.DELIVERED,
    (S.HELD, E.SELF_CONTAINED): S.MOVING,
    (S.HELD, E.OTHERS_READY): S.RECONNECTING,
    (S.HELD, E.BACKOFF_LEFT): S.RESENDING,
    (S.HELD, E.NOTHING_LEFT): S.RECONNECTING,
    (S.MOVING, E.OPENED): S.HELD,
    (S.MOVING, E.NONE_OPENED): S.RECONNECTING,
    (S.RESENDING, E.RESENT): S.HELD,
    (S.RESENDING, E.SOCKET_GONE): S.RECONNECTING,
    (S.SERVED, E.AFTER_OUTPUT): S.RECONNECTING,
}


@dataclass
class TurnMachine:
    """The current turn of one client socket. `cooldown_wait` bounds a resend's backoff; `now` is the
    health clock's (for an upstream's Retry-After hint)."""

    cooldown_wait: float
    now: Callable[[], float]
    state: TurnState = TurnState.HELD
    sends: int = 1  # attempts of this turn on its current socket's credential (the first included)
    delay: float = 0.0  # RESENDING: how long before the resend

    def new_turn(self) -> None:
        self.state, self.sends, self.delay = TurnState.HELD, 1, 0.0

    def fire(self, event: TurnEvent) -> TurnState:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise ValueError(f"turn: no transition from {self.state.value} on {event.value}")
        self.state = nxt
        if nxt is TurnState.HELD and event is TurnEvent.OPENED:
            self.sends = 1  # a new socket: its own count (the turn's loop counts across sockets)
        elif event is TurnEvent.RESENT:
            self.sends += 1
        return nxt

    def settle(self, scope: Scope, cand: Candidate, rejection: Rejection | None, windows: list[Window],
               movable: bool | None, others_ready: Callable[[], bool], after_output: bool = False) -> TurnState:
        """A turn's window closed on `cand`'s socket (rejection None: it serves), or (`after_output`)
        a served turn was rejected after its output began. The pool learns by the same rules as an
        HTTP attempt (`learn`); the turn goes on by TRANSITIONS."""
        if rejection is None:
            scope.feedback.succeeded(cand.key, scope.session, scope.model)
            return self.fire(TurnEvent.SERVED)
        scope.feedback.usage_seen(cand.key, cand.name, windows, scope.pool.policy, scope.where, cand.full_at)
        learn(scope, cand, rejection)
        if after_output:  # (a rules rejection class: never the client's own refusal)
            return self.fire(TurnEvent.AFTER_OUTPUT)
        return self.fire(self._event(scope, cand, rejection, movable, others_ready))

    def _event(self, scope: Scope, cand: Candidate, rejection: Rejection, movable: bool | None,
               others_ready: Callable[[], bool]) -> TurnEvent:
        if own_refusal(rejection.reason, cand):
            scope.feedback.client_refused(scope.client_auth)  # never lent the pool, as on HTTP
            return TurnEvent.OWN_REFUSAL
        if rejection.reason == STATE_LOST:
            return TurnEvent.STATE_LOST  # nothing else could serve it; Codex's re-send is whole
        models = scope.feedback.health.models
        if rejection.reason == MODEL_NOT_ENTITLED and models.likely_no_model(scope.model, models.lacking(scope.model)):
            return TurnEvent.NO_SUCH_MODEL  # nobody was seen serving it: the service's answer, not every account asked
        if movable is None:
            return TurnEvent.NO_TURN
        if movable:
            return TurnEvent.SELF_CONTAINED
        if others_ready():
            return TurnEvent.OTHERS_READY
        delay = backoff_delay(rejection, self.sends, self.cooldown_wait, self.now())
        if delay is None:
            return TurnEvent.NOTHING_LEFT
        self.delay = delay
        return TurnEvent.BACKOFF_LEFT


class Reconnects:
    """The sessions whose socket the gate closed with RECONNECT_CLOSE because nothing could serve their
    turn (exhausted: no credential ready, the backoff spent). Codex reconnects up to five times, and
    each new socket would meet the same exhaustion (the pool keeps one credential back from a burst,
    so the upgrade itself succeeds) and close again: the session's next upgrade within `window` is
    answered 426 instead, and Codex re-sends over HTTP at once, where the exhausted answer says when to
    try again (503 with Retry-After, or 429 with the reset time). Bounded: at most `limit` sessions,
    the oldest forgotten first. Pure, on an injected clock."""

    def __init__(self, clock: Callable[[], float], window: float = 60.0, limit: int = 4096):
        self.clock, self.window, self.limit = clock, window, limit
        self._closed: dict[str, float] = {}  # session -> when its socket closed exhausted (oldest first)

    def closed_exhausted(self, session: str | None) -> None:
        if session is None:
            return
        self._closed.pop(session, None)
        self._closed[session] = self.clock()
        while len(self._closed) > self.limit:
            del self._closed[next(iter(self._closed))]

    def downgrade(self, session: str | None) -> bool:
        """At an upgrade: does this session go over HTTP now (its last socket closed exhausted, lately)?
        Asked once: the session's next upgrade after this one is gated again."""
        closed = self._closed.pop(session, None) if session is not None else None
        return closed is not None and self.clock() - closed <= self.window


def goes_home(stays_home: bool, home: str, current: str) -> bool:
    """A turn bound to one account (a compaction item, the pin) that arrived on another account's
    socket goes to a new socket on `home` (the credential holding its state) before it is sent."""
    return stays_home and home != current


def exhausted_answer(turn_rejection: Rejection, socket_open: bool, last_dial: Rejection | None) -> Rejection:
    """What a DELIVERED turn is answered with: its own rejection while its socket is open (the rest
    of that response follows from there); once it closed, the last rejection the dialer saw (a
    failed upgrade's, as a status-bearing `error` frame), if any."""
    return turn_rejection if socket_open or last_dial is None else last_dial


def cannot_go_home(why_pinned: str | None) -> Rejection:
    """A turn bound to a credential that could not serve it even after its probe (failover_loop.py):
    the HTTP path's answer for a request that may not move and finds its credential cooling."""
    why = (f"codex-failover: this request cannot leave the credential holding its state ({why_pinned}), "
           f"which cannot serve it now")
    error: dict[str, Any] = {"type": "service_unavailable_error", "code": NO_USABLE_CREDENTIAL, "message": why}
    return Rejection(NO_USABLE_CREDENTIAL, 503, error)


def client_close_after_upstream(code: int | None) -> int:
    """The client's close code when its upstream socket ended outside a turn's window: the upstream's
    own, except a vanished upstream (1006, or no code), which would reach Codex as a clean 1000."""
    return INTERNAL_CLOSE if code in (None, ABNORMAL) else code


def upstream_close_after_client(code: int | None) -> int:
    """The upstream's close code when the session ends: the client's own, or 1000."""
    return NORMAL_CLOSE if code in (None, ABNORMAL) else code


def client_close_at_end(client_open: bool) -> int:
    """The client's close code when the session ends by itself: 1011 while the client is still there
    (the gate ended it), else 1000."""
    return INTERNAL_CLOSE if client_open else NORMAL_CLOSE
