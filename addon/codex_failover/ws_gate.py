"""The WebSocket gate (`failover_websocket: gate`): Codex keeps its Responses WebSocket, and every
turn on it is held and classified like an SSE stream.

The addon owns the upstream side. At the upgrade it opens its own upstream WebSocket with the
first credential that can serve it (credential swapped, through that credential's route); when
none can, the upgrade is answered 426 and Codex continues on SSE. The client's flow is then pointed
at the loopback relay, which answers the upgrade with the upstream's headers and runs a
`GateSession` between the two sockets. Owning both ends keeps order and exactly-once delivery
trivial, lets a moved turn continue on another credential's socket, and closes the client with a
chosen code, all without mitmproxy internals (docs/websocket-gate-notes.md has why).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import ssl
import time
from dataclasses import dataclass, field

from mitmproxy import http

from .affinity import Affinity, session_of
from .auth import auth_from_headers
from .classifier import Decision, Verdict
from .codex_request import swap_credential
from .config import PoolConfig
from .health import Health
from .outcomes import Outcomes
from .planner import Candidate, make_plan
from .replay_safety import PIN_HEADER
from .routes import RouteHealth
from .rules import Rules
from .socks_bridge import SocksBridges
from .taxonomy import FAILOVER, classify_response, error_object, exhausted_status
from .transport import HOST_NETWORK, PRE_DISPATCH, TLS_FAILED
from .usage import from_event
from .ws_conn import ABNORMAL, HANDSHAKE_HEADERS, HandshakeRejected, Message, WsConn
from .ws_turns import Step, Turn, TurnGate
from .ws_upstream import ConnectFailed, Target, open_upstream

log = logging.getLogger("codex_failover")

# Codex treats a socket that closes during a turn as a transport error: it reconnects and sends
# the full request on a new socket (verified with Codex 0.169, see tests/test_codex_cli.py).
RECONNECT_CLOSE = 1012  # "service restart"
UPGRADE_REFUSED = "upgrade_refused"  # a non-101 answer that is not a known rejection
HANDSHAKE_FAILED = "handshake_failed"


@dataclass
class Rejection:
    reason: str
    status: int | None
    error: dict
    frames: tuple[Message, ...] = ()  # the rejection as upstream sent it, if it came in-stream
    retry_after: str | None = None

    def as_frames(self) -> tuple[Message, ...]:
        """What the client gets on exhaustion: upstream's own messages, or a status-bearing
        `error` frame shaped like Codex's wrapped errors."""
        if self.frames:
            return self.frames
        status = self.status or exhausted_status(self.reason)
        error = {"type": self.error.get("type") or "upstream_error", "code": self.error.get("code") or self.reason,
                 "message": self.error.get("message") or f"codex-failover: {self.reason}"}
        body = {"type": "error", "status": status, "error": error}
        return ((json.dumps(body, separators=(",", ":")).encode(), True),)


@dataclass
class Upstream:
    conn: WsConn
    cand: Candidate
    route: str  # the endpoint's label, or direct


@dataclass
class GateContext:
    """What every gated socket shares with the rest of the addon."""

    pool: PoolConfig
    rules: Rules
    health: Health
    affinity: Affinity
    outcomes: Outcomes
    route_health: RouteHealth
    bridges: SocksBridges
    tls: ssl.SSLContext


class WebsocketGate:
    def __init__(self) -> None:
        self.sessions: dict[str, GateSession] = {}
        self._ids = itertools.count(1)

    async def open(self, flow: http.HTTPFlow, ctx: GateContext) -> tuple["GateSession | None", str]:
        """The session for a gated upgrade with its upstream open, or None and why not."""
        sid = f"w{next(self._ids)}"
        session = GateSession(sid, flow, ctx, self)
        why = await session.connect_first()
        if why is not None:
            return None, why
        self.sessions[sid] = session
        return session, ""

    def report(self) -> list[dict]:
        return [s.report() for s in self.sessions.values()]


@dataclass(eq=False)
class GateSession:
    sid: str
    flow: http.HTTPFlow
    ctx: GateContext
    owner: WebsocketGate
    up: Upstream | None = None
    down: WsConn | None = None
    tried: set[str] = field(default_factory=set)
    history: list[str] = field(default_factory=list)  # one line per attempt, for comments and status
    backlog: list[Message] = field(default_factory=list)  # client messages while a turn moves
    moving: bool = False
    moves: int = 0
    last: Rejection | None = None
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # the relay's one-time token

    def __post_init__(self) -> None:
        req = self.flow.request
        self.url = req.url
        self.headers = req.headers.copy()
        self.client_auth = auth_from_headers(req.headers)
        self.session = session_of(req.headers, None)
        self.pinned = req.headers.get(PIN_HEADER, "").strip().lower() in ("1", "true", "yes")
        policy = self.ctx.pool.policy
        self.gate = TurnGate(self.ctx.rules, policy.bootstrap_timeout, time.monotonic, policy.encrypted_reasoning)
        self.started = time.monotonic()

    # -- choosing an upstream --------------------------------------------------------------

    def candidates(self) -> list[Candidate]:
        sticky = self.ctx.affinity.get(self.session)
        plan = make_plan(self.client_auth, self.ctx.pool, self.ctx.health, not self.pinned, sticky)
        return [c for c in plan.candidates if c.key not in self.tried]

    async def connect_first(self) -> str | None:
        """At the upgrade: the first candidate whose upstream accepts. None, or why none did."""
        self.up = await self._open_next()
        if self.up is None:
            why = "; ".join(self.history) or "every credential is cooling or out of rotation"
            self._note(f"upgrade answered 426, Codex continues on SSE ({why})")
            return why
        self._note(f"socket on {self.up.cand.name} via {self.up.route}")
        return None

    async def _open_next(self) -> Upstream | None:
        attempts = 0
        while attempts < self.ctx.pool.policy.max_attempts:
            queue = self.candidates()
            if not queue:
                return None
            cand = queue[0]
            self.tried.add(cand.key)
            attempts += 1
            up = await self._open(cand)
            if up is not None:
                return up
            if self.last is not None and self.last.reason == TLS_FAILED:
                return None  # fails closed: never retried elsewhere (DESIGN §5)
        return None

    async def _open(self, cand: Candidate) -> Upstream | None:
        """One credential, through the endpoints of its route in order."""
        endpoints = self.ctx.pool.routes.get(cand.route) or (None,)
        failures = []
        for ep in endpoints:
            if ep is not None and not self.ctx.route_health.claim(ep):
                failures.append(f"{ep.label}: {self.ctx.route_health.describe(ep)}")
                continue
            label = ep.label if ep else "direct"
            try:
                conn = await self._dial(cand, ep)
            except ConnectFailed as exc:
                if ep is not None and exc.kind == PRE_DISPATCH:
                    backoff = self.ctx.route_health.failed(ep, str(exc))
                    log.warning("[%s] %s failed before dispatch (%s); not dialled again for %ds", self.sid, label, exc, backoff)
                    failures.append(f"{label}: {exc}")
                    continue
                if ep is not None:
                    self.ctx.route_health.release(ep) if exc.kind == HOST_NETWORK else self.ctx.route_health.succeeded(ep)
                self._rejected(cand, label, Rejection(exc.kind, None, {"message": str(exc)}))
                return None
            except HandshakeRejected as exc:
                self._route_ok(ep)
                self._upgrade_rejected(cand, label, exc)
                return None
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                self._route_ok(ep)
                self._rejected(cand, label, Rejection(HANDSHAKE_FAILED, None, {"message": f"{type(exc).__name__}: {exc}"}))
                return None
            self._route_ok(ep)
            self.history.append(f"{cand.name} via {label}: upgrade accepted")
            return Upstream(conn, cand, label)
        message = f"route {cand.route}: no endpoint could be used ({'; '.join(failures)})"
        self._rejected(cand, cand.route, Rejection("route_down", 502, {"message": message}))
        return None

    def _route_ok(self, ep) -> None:
        if ep is not None:
            self.ctx.route_health.succeeded(ep)

    async def _dial(self, cand: Candidate, ep) -> WsConn:
        policy = self.ctx.pool.policy
        headers = self.headers.copy()
        if cand.auth is not None:
            swap_credential(headers, cand.auth, moved=not cand.is_client)
        fields = [(k.encode(), v.encode()) for k, v in headers.items(multi=True)
                  if k.lower() not in HANDSHAKE_HEADERS and k.lower() != PIN_HEADER]
        url = cand.base_url + "/responses" if cand.base_url else self.url
        deflate = "permessage-deflate" in self.headers.get("sec-websocket-extensions", "")
        return await open_upstream(Target.from_url(url), fields, ep, self.ctx.bridges, self.ctx.tls,
                                   policy.connect_timeout, policy.response_timeout, deflate)

    def _upgrade_rejected(self, cand: Candidate, label: str, exc: HandshakeRejected) -> None:
        verdict = classify_response(exc.status, exc.body, self.ctx.rules)
        retry_after = next((v.decode("latin-1") for k, v in exc.headers if k.lower() == b"retry-after"), None)
        if verdict.verdict == FAILOVER:
            reason = verdict.reason
        else:
            reason = UPGRADE_REFUSED  # e.g. an upstream without the WebSocket transport: Codex can use SSE
        self._rejected(cand, label, Rejection(reason, exc.status, dict(verdict.error or error_object(exc.body)),
                                              retry_after=retry_after))

    def _rejected(self, cand: Candidate, label: str, rejection: Rejection) -> None:
        self.last = rejection
        if rejection.reason not in (UPGRADE_REFUSED, HANDSHAKE_FAILED, PRE_DISPATCH, HOST_NETWORK, TLS_FAILED, "route_down"):
            self.ctx.outcomes.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                                       rejection.retry_after, self.ctx.pool.policy, f"[{self.sid}] ")
        status = f" HTTP {rejection.status}" if rejection.status else ""
        detail = str(rejection.error.get("message") or "")[:200]
        self.history.append(f"{cand.name} via {label}: failover ({rejection.reason}{status}){': ' + detail if detail else ''}")
        log.info("[%s] websocket credential=%s route=%s verdict=failover reason=%s status=%s", self.sid, cand.name,
                 label.replace(" ", "="), rejection.reason, rejection.status)

    # -- serving (called by the relay once mitmproxy connects) -----------------------------

    def relay_headers(self) -> list[tuple[bytes, bytes]]:
        """The upstream's 101 headers (turn state, model...) for the client's 101."""
        return [(k, v) for k, v in self.up.conn.response_headers if k.decode("latin-1").lower() not in HANDSHAKE_HEADERS]

    async def serve(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.down = WsConn.accept(head, reader, writer, self.relay_headers())
        loop = asyncio.get_running_loop()
        client = loop.create_task(self._from_client())
        upstream = loop.create_task(self._from_upstream())
        try:
            done, _ = await asyncio.wait({client, upstream}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    log.error("[%s] codex-failover internal error in the WebSocket gate: %r", self.sid, exc,
                              exc_info=exc)
                    self.down.close(1011, "codex-failover internal error")
        finally:
            for task in (client, upstream):
                task.cancel()
            await asyncio.gather(client, upstream, return_exceptions=True)
            self.abort()

    def abort(self) -> None:
        if self.up is not None:
            code = self.down.close_code if self.down is not None and self.down.close_code not in (None, ABNORMAL) else 1000
            self.up.conn.close(code)
        if self.down is not None:
            self.down.close(1000)
        if self.owner.sessions.pop(self.sid, None) is not None:
            self._log_end()

    async def _from_client(self) -> None:
        while (message := await self.down.recv()) is not None:
            turn = self.gate.client_message(message[0], message[1], self.headers)
            if turn is not None:
                if not self.moving:
                    self.tried = {self.up.cand.key}  # a new turn may move to any credential but this one
                log.info("[%s] turn %d on %s%s", self.sid, turn.n, self.up.cand.name,
                         "" if turn.movable else f" (cannot move: {turn.why_pinned})")
            if self.moving:
                self.backlog.append(message)
            else:
                await self.up.conn.send(message)

    async def _from_upstream(self) -> None:
        while True:
            up = self.up
            message = await self._next_upstream(up)
            if message == "tick":
                step = self.gate.tick()
            elif message is None:
                step = self.gate.upstream_closed()
            else:
                step = self.gate.server_message(*message)
                self._watch_usage(up, message)
            for out in step.release:
                await self.down.send(out)
            if step.decision is not None:
                await self._decided(up, step)
                if not self.down.open:
                    return
                if self.up is not up:
                    continue  # the turn moved to a new socket
            if message is None and self.up is up:
                self._upstream_ended(up)
                return

    async def _next_upstream(self, up: Upstream) -> Message | str | None:
        deadline = self.gate.deadline
        if deadline is None:
            return await up.conn.recv()
        try:
            return await asyncio.wait_for(up.conn.recv(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return "tick"

    def _watch_usage(self, up: Upstream, message: Message) -> None:
        if b'"codex.rate_limits"' in message[0][:64]:
            try:
                payload = json.loads(message[0])
            except ValueError:
                return
            self.ctx.outcomes.usage_seen(up.cand.key, up.cand.name, from_event(payload), self.ctx.pool.policy,
                                         f"[{self.sid}] ")

    def _upstream_ended(self, up: Upstream) -> None:
        code = up.conn.close_code
        # A vanished upstream (1006) would reach the client as a clean 1000: say 1011 instead.
        self.down.close(1011 if code in (None, ABNORMAL) else code, up.conn.close_reason)

    # -- a turn's window closed ------------------------------------------------------------

    async def _decided(self, up: Upstream, step: Step) -> None:
        decision, turn = step.decision, self.gate.turn
        if decision.verdict is not Verdict.FAILOVER:
            self.ctx.outcomes.succeeded(up.cand.key, self.session)
            self._attempt_line(up, turn, decision.verdict.value, decision.reason)
            return
        rejection = self._rejection(decision, step)
        self.last = rejection
        self.ctx.outcomes.rejected(up.cand.key, up.cand.name, rejection.reason, rejection.status, rejection.error,
                                   None, self.ctx.pool.policy, f"[{self.sid}] ")
        self._attempt_line(up, turn, FAILOVER, rejection.reason)
        if turn is not None and turn.movable:
            await self._move(up, turn)
        elif turn is not None and self._others_ready(up):
            self._note(f"turn {turn.n} rejected ({rejection.reason}) and cannot move ({turn.why_pinned}); "
                       f"closing the client socket with {RECONNECT_CLOSE} so Codex reconnects with the full request")
            up.conn.close(1000)
            self.down.close(RECONNECT_CLOSE, "codex-failover: reconnect")
        else:
            await self._exhausted(up)

    def _others_ready(self, up: Upstream) -> bool:
        """Would a reconnect find another credential (not the one that just rejected)?"""
        plan = make_plan(self.client_auth, self.ctx.pool, self.ctx.health, not self.pinned)
        return any(c.key != up.cand.key for c in plan.candidates)

    def _rejection(self, decision: Decision, step: Step) -> Rejection:
        error = dict(decision.error or {})
        status = error.get("status") if isinstance(error.get("status"), int) else None
        return Rejection(decision.reason, status, error, step.held)

    async def _move(self, old: Upstream, turn: Turn) -> None:
        """A self-contained turn was rejected: the same create on the next credential's socket."""
        self.moving = True
        try:
            new = await self._open_next()
            if new is None:
                return await self._exhausted(old)
            old.conn.close(1000, "codex-failover: moved")
            self.up = new
            self.moves += 1
            self.gate.reopen()
            self._note(f"turn {turn.n} moved to {new.cand.name} via {new.route}; the socket is pinned there")
            await new.conn.send(turn.create_for_move())
            while self.backlog:  # what the client sent meanwhile, in order (it may grow while we send)
                await new.conn.send(self.backlog.pop(0))
        finally:
            self.moving = False

    async def _exhausted(self, up: Upstream) -> None:
        """Nothing else can serve the turn: the client gets the last rejection as upstream sent it
        (or a status-bearing `error` frame). The session goes on if its upstream is still open."""
        self._note(f"no other credential can serve turn {self.gate.turn.n if self.gate.turn else 0}: "
                   f"delivering the rejection ({self.last.reason if self.last else 'none'})")
        for frame in self.last.as_frames() if self.last else ():
            await self.down.send(frame)
        if not up.conn.open:
            self.down.close(1011, "codex-failover: upstream closed")

    # -- visibility ------------------------------------------------------------------------

    def _attempt_line(self, up: Upstream, turn: Turn | None, verdict: str, reason: str) -> None:
        n = turn.n if turn else 0
        self.history.append(f"turn {n}: {up.cand.name} via {up.route}: {verdict} ({reason})")
        log.info("[%s] turn %d credential=%s route=%s verdict=%s reason=%s", self.sid, n, up.cand.name,
                 up.route.replace(" ", "="), verdict, reason)
        self._comment()

    def _note(self, text: str) -> None:
        self.history.append(text)
        log.info("[%s] %s", self.sid, text)
        self._comment()

    def _comment(self) -> None:
        lines = self.history[-20:]  # a long session keeps only its latest lines in the comment
        self.flow.comment = f"codex-failover websocket {self.sid}:\n" + "\n".join(lines)

    def _log_end(self) -> None:
        elapsed = time.monotonic() - self.started
        log.info("[%s] websocket ended after %.1fs, %d turn(s), %d move(s)", self.sid, elapsed, self.gate.turns, self.moves)

    def report(self) -> dict:
        up = self.up
        return {"id": self.sid, "credential": up.cand.name if up else None, "route": up.route if up else None,
                "turns": self.gate.turns, "moves": self.moves, "holding": self.gate.holding,
                "open_s": round(time.monotonic() - self.started, 1)}
