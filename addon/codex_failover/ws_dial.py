"""Choosing and opening the upstream WebSocket of a gated session: credentials in policy order,
each through the endpoints of its route, until one accepts the upgrade. A handshake carries no
conversation, so any failure may move on (except TLS verification, which fails closed)."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections import deque
from dataclasses import dataclass

from .affinity import Affinity, session_of
from .auth import auth_from_headers
from .codex_request import swap_credential
from .config import PoolConfig
from .health import Health
from .outcomes import Outcomes
from .planner import Candidate, make_plan
from .replay_safety import PIN_HEADER
from .routes import Endpoint, RouteHealth
from .rules import Rules
from .socks_bridge import SocksBridges
from .taxonomy import AUTH_REJECTED, FAILOVER, classify_response, error_object, exhausted_status
from .transport import HOST_NETWORK, PRE_DISPATCH, ROUTE_DOWN, TLS_FAILED
from .ws_conn import HANDSHAKE_HEADERS, HandshakeRejected, Message, WsConn
from .ws_upstream import ConnectFailed, Target, open_upstream

log = logging.getLogger("codex_failover")

UPGRADE_REFUSED = "upgrade_refused"  # a non-101 answer that is not a known rejection
HANDSHAKE_FAILED = "handshake_failed"
# Handshake failures that say nothing about the credential: nothing cools.
_NOT_THE_CREDENTIAL = {UPGRADE_REFUSED, HANDSHAKE_FAILED, PRE_DISPATCH, HOST_NETWORK, TLS_FAILED, ROUTE_DOWN}


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


class Dialer:
    """Opens upstream sockets for one client socket; remembers which credentials this turn tried."""

    def __init__(self, sid: str, request, ctx: GateContext, history: deque[str]):
        # `history` is the session's: a plain shared deque, not a callback into the session, so a
        # finished session is freed by reference counting (no cycle to wait for the collector).
        self.sid, self.ctx, self.history = sid, ctx, history
        self.url = request.url
        self.headers = request.headers.copy()
        self.client_auth = auth_from_headers(request.headers)
        self.session = session_of(request.headers, None)
        self.pinned = request.headers.get(PIN_HEADER, "").strip().lower() in ("1", "true", "yes")
        self.tried: set[str] = set()  # credentials this turn was sent to (or whose upgrade failed)
        self.attempts = 0  # sockets this turn used or tried, bounded by max_attempts
        self.last: Rejection | None = None

    def candidates(self) -> list[Candidate]:
        sticky = self.ctx.affinity.get(self.session)
        plan = make_plan(self.client_auth, self.ctx.pool, self.ctx.health, not self.pinned, sticky)
        return [c for c in plan.candidates if c.key not in self.tried]

    def others_ready(self, key: str) -> bool:
        """Would a reconnect find a credential other than `key`?"""
        plan = make_plan(self.client_auth, self.ctx.pool, self.ctx.health, not self.pinned)
        return any(c.key != key for c in plan.candidates)

    def new_turn(self, key: str) -> None:
        """A new turn starts on the socket of credential `key` (its first attempt)."""
        self.tried, self.attempts = {key}, 1

    async def open_next(self) -> Upstream | None:
        """The next candidate's socket, within this turn's attempts; None when none opens."""
        while self.attempts < self.ctx.pool.policy.max_attempts and (queue := self.candidates()):
            up = await self._try(queue[0])
            if up is not None or self._final(queue[0]):
                return up
        return None

    async def open_home(self) -> Upstream | None:
        """A socket on the client's own credential (for a request that may not leave it)."""
        plan = make_plan(self.client_auth, self.ctx.pool, self.ctx.health, movable=False)
        if not plan.candidates or self.attempts >= self.ctx.pool.policy.max_attempts:
            return None
        return await self._try(plan.candidates[0])

    async def _try(self, cand: Candidate) -> Upstream | None:
        self.tried.add(cand.key)
        self.attempts += 1
        return await self._open(cand)

    def _final(self, cand: Candidate) -> bool:
        """Stop trying others: a TLS verification failure fails closed (docs/architecture.md#replay-safety); the client's
        own 401/403 must reach Codex (426 sends it to SSE, where it gets its own answer)."""
        reason = self.last.reason if self.last else None
        return reason == TLS_FAILED or (reason == AUTH_REJECTED and cand.is_client)

    async def _open(self, cand: Candidate) -> Upstream | None:
        """One credential, through the endpoints of its route in order; an endpoint that fails
        before the upgrade left backs off and the next is tried."""
        failures = []
        for ep in self.ctx.pool.routes.get(cand.route) or (None,):
            if ep is not None and not self.ctx.route_health.claim(ep):
                failures.append(f"{ep.label}: {self.ctx.route_health.describe(ep)}")
                continue
            label = ep.label if ep else "direct"
            outcome = await self._through(cand, ep, label)
            if isinstance(outcome, Upstream):
                return outcome
            if outcome is None:  # this endpoint is down
                failures.append(f"{label}: {self.ctx.route_health.describe(ep)}")
                continue
            self._rejected(cand, label, outcome)
            return None
        message = f"route {cand.route}: no endpoint could be used ({'; '.join(failures)})"
        self._rejected(cand, cand.route, Rejection(ROUTE_DOWN, 502, {"message": message}))
        return None

    async def _through(self, cand: Candidate, ep: Endpoint | None, label: str) -> Upstream | Rejection | None:
        """The upgrade through one endpoint: the socket, a rejection, or None (endpoint down)."""
        health = self.ctx.route_health
        try:
            conn = await self._dial(cand, ep)
        except ConnectFailed as exc:
            if ep is not None and exc.kind == PRE_DISPATCH:
                backoff = health.failed(ep, str(exc))
                log.warning("[%s] %s failed before dispatch (%s); not dialled again for %ds", self.sid, label, exc, backoff)
                return None
            if ep is not None:
                health.release(ep) if exc.kind == HOST_NETWORK else health.succeeded(ep)
            return Rejection(exc.kind, None, {"message": str(exc)})
        except HandshakeRejected as exc:
            outcome = self._upgrade_rejected(exc)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            outcome = Rejection(HANDSHAKE_FAILED, None, {"message": f"{type(exc).__name__}: {exc}"})
        except BaseException:
            if ep is not None:
                health.release(ep)  # a probe that never finished must not keep the endpoint claimed
            raise
        else:
            outcome = Upstream(conn, cand, label)
        if ep is not None:
            health.succeeded(ep)
        return outcome

    async def _dial(self, cand: Candidate, ep: Endpoint | None) -> WsConn:
        policy = self.ctx.pool.policy
        headers = self.headers.copy()
        if cand.auth is not None:
            swap_credential(headers, cand.auth, moved=not cand.is_client)
        fields = [(k.encode(), v.encode()) for k, v in headers.items(multi=True)
                  if k.lower() not in HANDSHAKE_HEADERS and k.lower() != PIN_HEADER]
        url = cand.base_url + "/responses" if cand.base_url else self.url
        deflate = "permessage-deflate" in self.headers.get("sec-websocket-extensions", "")
        # The upgrade's answer is bounded by connect_timeout too: a silent upstream must reach
        # Codex as a quick 426 (SSE), not after its own handshake timeout and reconnect attempts.
        return await open_upstream(Target.from_url(url), fields, ep, self.ctx.bridges, self.ctx.tls,
                                   policy.connect_timeout, policy.connect_timeout, deflate)

    def _upgrade_rejected(self, exc: HandshakeRejected) -> Rejection:
        verdict = classify_response(exc.status, exc.body, self.ctx.rules)
        retry_after = next((v.decode("latin-1") for k, v in exc.headers if k.lower() == b"retry-after"), None)
        # Not a known rejection (e.g. an upstream without the WebSocket transport): Codex can use SSE.
        reason = verdict.reason if verdict.verdict == FAILOVER else UPGRADE_REFUSED
        return Rejection(reason, exc.status, dict(verdict.error or error_object(exc.body)), retry_after=retry_after)

    def _rejected(self, cand: Candidate, label: str, rejection: Rejection) -> None:
        self.last = rejection
        if rejection.reason == AUTH_REJECTED and cand.is_client:
            pass  # the client's own credential: Codex hears about it itself, on SSE
        elif rejection.reason not in _NOT_THE_CREDENTIAL:
            self.ctx.outcomes.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                                       rejection.retry_after, self.ctx.pool.policy, f"[{self.sid}] ")
        status = f" HTTP {rejection.status}" if rejection.status else ""
        detail = str(rejection.error.get("message") or "")[:200]
        line = f"{cand.name} via {label}: upgrade failed ({rejection.reason}{status}){': ' + detail if detail else ''}"
        self.history.append(line)
        log.info("[%s] %s", self.sid, line)
