"""The WebSocket gate (`failover_websocket: gate`): Codex keeps its Responses WebSocket, and every
turn on it is held and classified like an SSE stream.

The addon owns the upstream side. At the upgrade it opens its own upstream WebSocket with the
first credential that can serve it (credential swapped, through that credential's route); when
none can, the upgrade is answered 426 and Codex continues on SSE. The client's flow is then answered
in its own layers (mitm/held_stream.py: the stand-in answers 101 with the upstream's headers; ws/client_pipe.py),
or, as the fallback, pointed at the loopback relay, which does the same over a socket; a `GateSession`
runs between the two sides. Owning both ends keeps order and exactly-once delivery
trivial, lets a moved turn continue on another credential's socket, and closes the client with a
chosen code, all without mitmproxy internals (docs/websocket-gate-notes.md has why).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import logging
import secrets
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from mitmproxy import http

from ..core.attempt_events import Scope
from ..core.provenance import artifacts_of_message
from ..core.turn_machine import (
    Reconnects,
    TurnMachine,
    client_close_after_upstream,
    client_close_at_end,
    goes_home,
    upstream_close_after_client,
)
from ..core.usage import from_event
from ..core.ws_turns import TurnGate
from ..mitm import client_answers
from ..mitm.attempt import hide_secrets
from ..mitm.held_client import point_at_relay
from ..mitm.held_stream import HeldStream
from ..net.relay import Relay
from ..shared import Shared
from .client_pipe import serve_in_process
from .conn import HANDSHAKE_HEADERS, Message, WsConn
from .dial import Dialer, Upstream
from .socket_story import SocketStory
from .turn_ends import TurnEnds

log = logging.getLogger("codex_failover")

HISTORY_LINES = 50  # per socket, for its flow comment and log context
class _Tick(enum.Enum):
    TICK = "tick"


TICK = _Tick.TICK  # the hold's time budget ran out while waiting for the upstream


class WebsocketGate:
    def __init__(self, run: str = "") -> None:
        self.sessions: dict[str, GateSession] = {}
        self.reconnects = Reconnects(time.monotonic)  # sessions whose socket closed exhausted: 426 at their next upgrade
        self._ids = itertools.count(1)
        self._prefix = f"{run}-" if run else ""  # the proxy's run id (core/run_ids.py)

    async def open(self, flow: http.HTTPFlow, shared: Shared) -> tuple["GateSession | None", str]:
        """The session for a gated upgrade with its upstream open, or None and why not."""
        sid = f"{self._prefix}w{next(self._ids)}"
        session = GateSession(sid, flow, shared, self)
        why = await session.connect_first()
        if why is not None:
            return None, why
        self.sessions[sid] = session
        return session, ""

    async def upgrade(self, flow: http.HTTPFlow, shared: Shared, relay: Relay) -> None:
        """A gated upgrade: its upstream socket opened now (any credential, any route that works),
        the client's flow pointed at the relay; 426 if none can (Codex goes on over SSE)."""
        await relay.start()
        try:
            session, why = await self.open(flow, shared)
        except Exception as exc:  # noqa: BLE001 - a bug must not let the upgrade through ungated
            log.error("codex-failover internal error opening a gated WebSocket: %s\n%s", exc, traceback.format_exc())
            session, why = None, f"codex-failover internal error: {type(exc).__name__}"
        if session is None:
            flow.response = client_answers.websocket_downgrade(f"failover_websocket=gate: {why}")
            return
        hop = HeldStream.attach(flow, session.abort)
        if hop is not None:
            hop.decide(False)  # (never attempt 1 on the stream: the stand-in answers 101)
        if hop is None:  # the fallback: the client's flow goes to the loopback relay, which serves it
            point_at_relay(flow, relay.port, relay.register(session))
            return
        hide_secrets(flow.request)  # the dialer took what it needs; mitmweb and -w see placeholders
        session.serving = asyncio.get_running_loop().create_task(serve_in_process(session, hop))

    def report(self) -> list[dict]:
        return [s.report() for s in self.sessions.values()]


@dataclass(eq=False)
class GateSession(TurnEnds):
    sid: str
    flow: http.HTTPFlow
    shared: Shared
    owner: WebsocketGate
    up: Upstream | None = None
    down: WsConn | None = None
    history: deque[str] = field(default_factory=lambda: deque(maxlen=HISTORY_LINES))  # attempts, moves
    backlog: deque[Message] = field(default_factory=deque)  # client messages while a turn moves
    moving: bool = False
    ended: bool = False
    moves: int = 0
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # the relay's one-time token
    serving: asyncio.Task | None = None  # in process: the task that serves the client (the relay's otherwise)

    def __post_init__(self) -> None:
        self.reconnects = self.owner.reconnects
        self.dialer = Dialer(self.sid, self.flow, self.shared, self.history)
        self.story = SocketStory(self.sid, self.flow, self.history, self.shared.activity, self.dialer.session)
        policy = self.shared.pool.policy
        self.gate = TurnGate(self.shared.rules, policy.bootstrap_timeout, time.monotonic, policy.encrypted_reasoning,
                             self.shared.provenance.owner, stall=policy.first_event_timeout, max_hold=policy.max_hold)
        self.turns = TurnMachine(policy.cooldown_wait, self.shared.health.now)
        self.started = time.monotonic()
        shared = self.shared
        self.scope = Scope(shared.rules, shared.pool, shared.feedback, shared.provenance, shared.recovery_slots,
                                   time.monotonic, session=self.dialer.session, client_auth=self.dialer.client_auth,
                                   where=f"[{self.sid}] ")

    async def connect_first(self) -> str | None:
        """At the upgrade: the first candidate whose upstream accepts. None, or why none did."""
        if self.reconnects.downgrade(self.dialer.session):
            why = ("its last socket closed because nothing could serve its turn: over SSE, the exhausted "
                   "answer says when to try again")
            self.story.note(f"upgrade answered 426, Codex continues on SSE ({why})")
            return why
        self.up = await self.dialer.open_next()
        if self.up is None:
            why = "; ".join(self.history) or "every credential is cooling or out of rotation"
            self.story.note(f"upgrade answered 426, Codex continues on SSE ({why})")
            return why
        self.story.opened(self.up)
        return None

    # -- serving (called by the relay once mitmproxy connects) -----------------------------

    def relay_headers(self) -> list[tuple[bytes, bytes]]:
        """The upstream's 101 headers (turn state, model...) for the client's 101."""
        return [(k, v) for k, v in self.upstream.conn.response_headers if k.decode("latin-1").lower() not in HANDSHAKE_HEADERS]

    async def serve(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Through the relay (the fallback): the relay's hop is a WebSocket of its own."""
        self.down = WsConn.accept(head, reader, writer, self.relay_headers())
        await self.run()

    async def run(self) -> None:
        """Both sides are open (through the relay or in process): the session runs until either ends."""
        loop = asyncio.get_running_loop()
        tasks = {loop.create_task(self._from_client()), loop.create_task(self._from_upstream())}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Closing both sockets ends both loops by themselves (their reads see EOF). Cancelling
            # them instead would leave cancelled-task reference cycles holding this session, and
            # the zlib state of its upstream socket, until the next full garbage collection.
            self.abort()
            _, pending = await asyncio.wait(tasks, timeout=5)
            for task in pending:
                task.cancel()
            for task in tasks - pending:
                if task.exception() is not None:
                    exc = task.exception()
                    log.error("[%s] codex-failover internal error in the WebSocket gate: %r", self.sid, exc, exc_info=exc)

    def abort(self) -> None:
        """End the session: both sockets closed (the upstream with the client's code). Idempotent."""
        if self.ended:
            return
        self.ended = True
        if self.up is not None:
            self.up.conn.close(upstream_close_after_client(self.down.close_code if self.down is not None else None))
        if self.down is not None:
            self.down.close(client_close_at_end(self.down.open))
        self.owner.sessions.pop(self.sid, None)
        self.story.ended(time.monotonic() - self.started, self.gate.turns, self.moves)

    async def _from_client(self) -> None:
        while (message := await self.client.recv()) is not None:
            turn = self.gate.client_message(message[0], message[1], self.dialer.headers)
            if self.moving:
                self.backlog.append(message)
                continue
            if turn is not None:
                up = self.upstream
                self.story.turn(turn, up.cand.name)  # (its log line is its verdict: SocketStory.attempt)
                self.dialer.new_turn(up.cand.key)
                self.turns.new_turn()
                if goes_home(turn.stays_home, self.dialer.home_of(turn.bound_to), up.cand.key):
                    await self._go_home(turn)
                    continue
                message = turn.message_for(new_socket=False, foreign=not up.cand.is_client)
            await self.upstream.send(message)

    async def _from_upstream(self) -> None:
        while not self.ended:
            up = self.upstream
            message = await self._next_upstream(up)
            if self.ended:
                return  # our own close (the client left): not a rejection
            if self.up is not up:
                continue  # replaced while we waited (a turn went home): its end is ours, not news
            if message is TICK:
                step = self.gate.tick()
            elif message is None:
                step = self.gate.upstream_closed()
            else:
                step = self.gate.server_message(*message)
                up.leg.message(*message, from_client=False)
                self.story.message(message[0])
                watch_usage(self.shared, self.sid, up, message)
                self.shared.provenance.record(artifacts_of_message(message[0]), up.cand.key)
            for out in step.release:
                await self.client.send(out)
            if step.decision is not None:
                await self._decided(up, step)
                if not self.client.open:
                    return
                if self.up is not up:
                    continue  # the turn moved to a new socket
            if message is None and self.up is up:
                self._upstream_ended(up)
                return

    async def _next_upstream(self, up: Upstream) -> Message | _Tick | None:
        deadline = self.gate.deadline
        if deadline is None:
            return await up.conn.recv()
        try:
            return await asyncio.wait_for(up.conn.recv(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return TICK

    def _upstream_ended(self, up: Upstream) -> None:
        self.client.close(client_close_after_upstream(up.conn.close_code), up.conn.close_reason)

    # -- visibility ------------------------------------------------------------------------

    def report(self) -> dict:
        up = self.up
        return {"id": self.sid, "credential": up.cand.name if up else None, "route": up.route if up else None,
                "turns": self.gate.turns, "moves": self.moves, "holding": self.gate.holding,
                "open_s": round(time.monotonic() - self.started, 1)}


def watch_usage(shared: Shared, sid: str, up: Upstream, message: Message) -> None:
    """A `codex.rate_limits` event on a socket: what the pool learns of its credential's windows."""
    if b'"codex.rate_limits"' in message[0]:
        try:
            payload = json.loads(message[0])
        except ValueError:
            return
        shared.feedback.usage_seen(up.cand.key, up.cand.name, from_event(payload), shared.pool.policy,
                                   f"[{sid}] ", up.cand.full_at)
