"""What the WebSocket gate does when a turn's window closes: it asks the turn machine
(core/turn_machine.py) and carries out the state it comes to: served, moved (the turn's failover
loop opens the next socket, waiting as the HTTP path does), resent on the same socket after the
backoff, closed with 1012 so Codex reconnects, or delivered (the client's own refusal). A mixin of
ws/gate.GateSession: the session's sockets, dialer and story are its own."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any

from ..core.classifier import Decision
from ..core.codex_request import model_of
from ..core.outcomes import Rejection
from ..core.pool_reach import kind_gap
from ..core.turn_machine import (
    INTERNAL_CLOSE,
    NORMAL_CLOSE,
    RECONNECT_CLOSE,
    Reconnects,
    TurnEvent,
    TurnMachine,
    TurnState,
    cannot_go_home,
    exhausted_answer,
)
from ..core.usage import from_headers
from ..core.vocabulary import STATE_LOST, Verdict
from ..core.ws_turns import Step, Turn, TurnGate
from ..shared import Shared
from .conn import Message, WsConn
from .dial import Dialer, Upstream, as_frames


class TurnEnds:
    """The session's parts this side uses (GateSession, a dataclass, has them)."""

    shared: Shared
    up: Upstream | None
    down: WsConn | None
    backlog: deque[Message]
    moving: bool
    ended: bool
    moves: int
    dialer: Dialer
    story: Any  # socket_story.SocketStory
    gate: TurnGate
    turns: TurnMachine
    scope: Any  # attempt_events.Scope
    reconnects: Reconnects  # the gate's: sessions whose socket closed exhausted

    @property
    def upstream(self) -> Upstream:
        """The socket serving the session (from its first upstream's upgrade on)."""
        assert self.up is not None
        return self.up

    @property
    def client(self) -> WsConn:
        """The client's socket (once the session serves it: through the relay or in process)."""
        assert self.down is not None
        return self.down

    async def _decided(self, up: Upstream, step: Step) -> None:
        """The turn machine settles the turn (core/turn_machine.py, the HTTP path's rules); the gate
        carries out the state it comes to."""
        decision, turn = step.decision, self.gate.turn
        assert decision is not None  # (called for a step that decided)
        failed = decision.verdict is Verdict.FAILOVER
        rejection = _rejection(decision, step) if failed else None
        windows = from_headers(_wrapped_headers(step), self.shared.health.now()) if failed else []
        self.scope.model = model_of(turn.body) if turn else None  # (a credential may lack the turn's model)
        state = self.turns.settle(self.scope, up.cand, rejection, windows, turn.movable if turn else None,
                                  lambda: self.dialer.others_ready(up.cand.key), step.after_output)
        if rejection is None:
            self.story.attempt(up, turn, decision.verdict.value, decision.reason)
            return
        self.dialer.last = rejection
        self.story.attempt(up, turn, Verdict.FAILOVER, rejection.reason)
        if state is TurnState.MOVING and turn is not None:
            await self._move(up, turn, rejection)
        elif state is TurnState.RESENDING and turn is not None:
            await self._resend(up, turn, rejection)
        elif state is TurnState.RECONNECTING and turn is not None and step.after_output:
            self._reconnect(up, turn, rejection, "it came after the turn's output began: Codex re-sends the whole "
                            "request, which starts the answer over elsewhere")
        elif state is TurnState.RECONNECTING and turn is not None:
            spent = rejection.reason != STATE_LOST and not self.dialer.others_ready(up.cand.key)
            self._reconnect(up, turn, rejection, "its socket does not hold the response it continues"
                            if rejection.reason == STATE_LOST else
                            f"it cannot move ({turn.why_pinned}) and another credential is ready"
                            if not spent else
                            f"it cannot move ({turn.why_pinned}) and its credential's retries are spent", exhausted=spent)
        else:
            await self._exhausted(up, rejection)

    def _kind_gap(self) -> str:
        """Why nothing of the pool was offered, when it is the kind: `; ...cross_kind...` (or "")."""
        gap = kind_gap(self.dialer.client_auth, self.shared.pool)
        return f"; {gap}" if gap else ""

    def _reconnect(self, up: Upstream, turn: Turn, rejection: Rejection, why: str, exhausted: bool = False) -> None:
        """The turn ends in a close Codex retries: it reconnects and re-sends the full request, which the
        upgrade places anew (or answers 426: then the HTTP path answers it, its exhausted answer too). An
        exhausted turn's session is answered 426 at its next upgrade (core/turn_machine.Reconnects)."""
        if exhausted:
            self.reconnects.closed_exhausted(self.dialer.session)
        self.story.note(f"turn {turn.n} rejected ({rejection.reason}): {why}; closing the client socket with "
                        f"{RECONNECT_CLOSE} so Codex reconnects with the full request")
        up.conn.close(NORMAL_CLOSE)
        self.client.close(RECONNECT_CLOSE, "codex-failover: reconnect")

    async def _move(self, old: Upstream, turn: Turn, rejection: Rejection) -> None:
        """A self-contained turn was rejected: the same create on the socket its failover loop opens
        next (another credential; the only one after its backoff; one back within cooldown_wait)."""
        self.dialer.turn_rejected(rejection)

        async def none_opened() -> None:
            self.turns.fire(TurnEvent.NONE_OPENED)
            self.story.note(f"no other credential can serve turn {turn.n} now{self._kind_gap()}")
            self._reconnect(old, turn, rejection, "no credential can serve it now", exhausted=True)

        def opened(new: Upstream) -> str:
            self.turns.fire(TurnEvent.OPENED)
            same = new.cand.key == old.cand.key
            return (f"turn {turn.n} retried on {new.cand.name} via {new.route} (a new socket)" if same else
                    f"turn {turn.n} moved to {new.cand.name} via {new.route}; the socket is pinned there")

        await self._relocate(turn, self.dialer.open_next, none_opened, opened)

    async def _resend(self, up: Upstream, turn: Turn, rejection: Rejection) -> None:
        """A continued turn nothing else can serve now: the same create on the same socket after the
        only-credential backoff (client messages meanwhile wait in the backlog)."""
        delay = self.turns.delay
        self.story.note(f"turn {turn.n} rejected ({rejection.reason}) and cannot move ({turn.why_pinned}); "
                        f"retrying it on {up.cand.name} in {delay:.1f}s")
        self.moving = True
        try:
            await asyncio.sleep(delay)
            if self.ended:
                return
            if self.up is not up or not up.conn.open:
                self.turns.fire(TurnEvent.SOCKET_GONE)
                self._reconnect(up, turn, rejection, "its socket closed while it waited")
                return
            self.turns.fire(TurnEvent.RESENT)
            self.gate.reopen()
            await up.send(turn.message_for(new_socket=False, foreign=not up.cand.is_client))
            await self._flush_backlog()
        finally:
            self.moving = False

    async def _go_home(self, turn: Turn) -> None:
        """A self-contained turn bound to one account (a compaction item, the pin) arrived on another
        account's socket: it goes to a new socket on the credential holding its state (the one that
        made it, else the client's own), or fails as it would on HTTP when that one cannot serve."""
        await self._relocate(turn, lambda: self.dialer.open_home(turn.bound_to), lambda: self._cannot_go_home(turn),
                             lambda new: f"turn {turn.n} goes to the credential holding its state ({turn.why_pinned}): "
                                         f"socket moved to {new.cand.name}")

    async def _relocate(self, turn: Turn, dial, fallback, note) -> None:
        """Send `turn` on the socket `dial()` opens, pinning the session there, or run `fallback()`.
        Client messages meanwhile wait in the backlog."""
        self.moving = True
        try:
            old = self.upstream
            new = await dial()
            if self.ended:  # the client left while we dialled
                if new is not None:
                    new.conn.close(1001)
                return
            if new is None:
                await fallback()
            else:
                await self._switch(old, new, turn, note(new))
            await self._flush_backlog()
        finally:
            self.moving = False

    async def _cannot_go_home(self, turn: Turn) -> None:
        for message in self.gate.abandon():
            await self.client.send(message)
        busy = cannot_go_home(turn.why_pinned)
        self.story.note(f"turn {turn.n} must stay on the credential holding its state ({turn.why_pinned}); it cannot serve: 503")
        for frame in as_frames(busy):
            await self.client.send(frame)

    async def _switch(self, old: Upstream, new: Upstream, turn: Turn, note: str) -> None:
        old.conn.close(1000, "codex-failover: moved")
        self.up = new
        self.moves += 1
        self.gate.reopen()
        self.story.note(note)
        await new.send(turn.message_for(new_socket=True, foreign=not new.cand.is_client))

    async def _flush_backlog(self) -> None:
        """What the client sent while a turn moved, in order (it may grow while we send), to the
        socket in use; dropped if there is none."""
        while self.backlog:
            message = self.backlog.popleft()
            if self.upstream.conn.open:
                await self.upstream.send(message)

    async def _exhausted(self, up: Upstream, rejection: Rejection) -> None:
        """A DELIVERED turn (the client's own 401/403, or a rejection outside any turn). If its socket
        is still open, the client gets the rejection as upstream sent it (the rest of that response
        follows from there); if it closed, the last rejection seen, then a close."""
        last = exhausted_answer(rejection, up.conn.open, self.dialer.last)
        turn = self.gate.turn
        pinned = f", and it cannot move ({turn.why_pinned})" if turn is not None and not turn.movable else ""
        self.story.note(f"no other credential can serve turn {turn.n if turn else 0}{pinned}: "
                        f"delivering the rejection ({last.reason}){'' if pinned else self._kind_gap()}")
        for frame in as_frames(last, self.dialer.soonest()):
            await self.client.send(frame)
        if not up.conn.open:
            self.client.close(INTERNAL_CLOSE, "codex-failover: upstream closed")



def _rejection(decision: Decision, step: Step) -> Rejection:
    """An in-stream rejection: its error, status, upstream's own messages, and Retry-After from the
    wrapped error's `headers`."""
    error = dict(decision.error or {})
    status = error.get("status") if isinstance(error.get("status"), int) else None
    return Rejection(decision.reason, status, error, step.held, _wrapped_headers(step).get("retry-after"))


def _wrapped_headers(step: Step) -> dict[str, str]:
    """The `headers` a wrapped error carries (`{"type":"error","status":429,…,"headers":{…}}`),
    lower-cased; empty when the deciding message has none."""
    if not step.held:
        return {}
    try:
        headers = json.loads(step.held[-1][0]).get("headers")
    except (ValueError, AttributeError):
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()} if isinstance(headers, dict) else {}


