"""One held request, sans-I/O: the failover loop and each attempt's machine behind one interface,
so the shell's driver only moves bytes and carries out commands.

    m = RequestMachine(loop, scope)
    while True:
        step = m.next()
        Try(cand, ep, n)      start attempt n; until m.attempt.over: read by m.attempt.deadline,
                              carry out m.attempt.send(event) (attempt_machine's commands)
        Wait(seconds, why)    hold the client that long, checking it is still there
        RouteDown(...)        log it; ask again
        Done()                the client has its answer (committed or answered as is)
        GiveUp(commands, why) recovery ran out: the last attempt's own answer (commands), or, with
                              none, recovery_exhausted's
        Exhausted / AllCooling / Final   answer the client with it

The machine reports each attempt's result to the loop itself. `client_gone()` ends everything.
docs/architecture.md#the-request-machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from .attempt_events import Command, Scope
from .attempt_machine import AttemptMachine, learn
from .failover_loop import FailoverLoop
from .outcomes import (
    AllCooling,
    Exhausted,
    Final,
    RecoveryExhausted,
    Rejection,
    RouteDown,
    Served,
    Try,
    Wait,
    own_refusal,
)
from .planner import Candidate
from .usage import Window
from .vocabulary import MODEL_NOT_ENTITLED, STATE_LOST


@dataclass(frozen=True)
class Done:
    """An attempt served the client: the request is over."""


@dataclass(frozen=True)
class GiveUp:
    """Recovery's retries ran out: carry out `commands` on the last attempt; none: answer with
    recovery_exhausted(`why`)."""

    commands: tuple[Command, ...]
    why: str


RunStep = Union[Try, Wait, RouteDown, Done, GiveUp, Exhausted, AllCooling, Final]


class RequestMachine:
    def __init__(self, loop: FailoverLoop, scope: Scope):
        self.loop, self.scope = loop, scope
        self.attempt: AttemptMachine | None = None  # the attempt in flight, or the last one
        self.done = False

    def next(self) -> RunStep:
        attempt = self.attempt
        if self.done:
            return Done()
        if attempt is not None and attempt.result is not None and not attempt.reported:
            attempt.reported = True
            self.loop.report(attempt.result)
            if isinstance(attempt.result, Served):
                self.done = True
                return Done()
        assert attempt is None or attempt.over, "next() while an attempt is in flight"
        step = self.loop.next()
        if isinstance(step, Try):
            self.attempt = AttemptMachine(self.scope, step.candidate, step.endpoint)
        elif isinstance(step, RecoveryExhausted):
            assert self.attempt is not None
            return GiveUp(tuple(self.attempt.give_up(step.final)), step.why)
        return step

    def client_gone(self) -> list[Command]:
        """The client left (or the run was cancelled): the attempt in flight is cancelled, and no
        endpoint stays claimed."""
        attempt, self.done = self.attempt, True
        self.loop.abandon()
        if attempt is not None and not attempt.over:
            return attempt.client_gone()
        return []


# -- a WebSocket turn -------------------------------------------------------------------------

SERVED_TURN, MOVE, RECONNECT, EXHAUSTED = "served", "move", "reconnect", "exhausted"


def goes_home(stays_home: bool, home: str, current: str) -> bool:
    """A turn bound to one account (a compaction item, the pin) that arrived on another account's
    socket goes to a new socket on `home` (the credential holding its state) before it is sent."""
    return stays_home and home != current


def exhausted_answer(turn_rejection: Rejection, socket_open: bool, last_dial: Rejection | None) -> Rejection:
    """What a turn nothing else can serve is answered with: its own rejection while its socket is
    open (the rest of that response follows from there); once it closed, the last rejection the
    dialer saw (a failed upgrade's, as a status-bearing `error` frame), if any."""
    return turn_rejection if socket_open or last_dial is None else last_dial


def settle_turn(scope: Scope, cand: Candidate, rejection: Rejection | None, windows: list[Window],
                movable: bool | None, others_ready: Callable[[], bool]) -> str:
    """A gated turn's window closed on `cand`'s socket (rejection None: it serves). What the pool
    learns, by the same rules as an HTTP attempt (`learn`), and what the gate does next:
    SERVED_TURN; MOVE (self-contained: the same create on the next credential's socket); RECONNECT
    (it cannot move, but another credential could serve Codex's full re-send: close with 1012);
    EXHAUSTED (deliver the rejection). A turn whose socket lost its state (STATE_LOST) always
    reconnects: nothing else could serve it, and Codex's re-send is whole. `movable` is None outside a
    turn."""
    if rejection is None:
        scope.feedback.succeeded(cand.key, scope.session, scope.model)
        return SERVED_TURN
    scope.feedback.usage_seen(cand.key, cand.name, windows, scope.pool.policy, scope.where, cand.full_at)
    learn(scope, cand, rejection)
    if own_refusal(rejection.reason, cand):
        scope.feedback.client_refused(scope.client_auth)  # never lent the pool, as on HTTP
        return EXHAUSTED
    if rejection.reason == STATE_LOST:
        return RECONNECT  # the socket lost the turn's state: Codex's re-send carries its full input
    models = scope.feedback.health.models
    if rejection.reason == MODEL_NOT_ENTITLED and models.likely_no_model(scope.model, models.lacking(scope.model)):
        return EXHAUSTED  # a model nobody was seen serving: the service's answer, not every account asked
    if movable:
        return MOVE
    if movable is not None and others_ready():
        return RECONNECT
    return EXHAUSTED
