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

from dataclasses import dataclass
from typing import Union

from .attempt_events import Command, Scope
from .attempt_machine import AttemptMachine
from .failover_loop import FailoverLoop
from .outcomes import (
    AllCooling,
    Exhausted,
    Final,
    RecoveryExhausted,
    RouteDown,
    Served,
    Try,
    Wait,
)


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
