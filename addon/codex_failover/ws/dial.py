"""Choosing and opening the upstream WebSocket of a gated session: credentials in policy order,
each through the endpoints of its route, until one accepts the upgrade. The failover loop
(failover_loop.py, the same as the HTTP path's) decides; this module dials. A handshake carries no
conversation, so any failure may move on (except TLS verification, which fails closed)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass

from mitmproxy import http

from ..core import story
from ..core.affinity import affinity_key, session_of
from ..core.auth import auth_from_headers
from ..core.codex_request import swap_credential
from ..core.failover_loop import FailoverLoop
from ..core.outcomes import SERVED, Rejected, Rejection, RouteDown, Try, Wait, cools, own_refusal
from ..core.planner import Candidate, Plan, make_plan
from ..core.pool_wait import Soonest, back_in, soonest, time_fields
from ..core.replay_safety import PIN_HEADER, assess
from ..core.routes import Endpoint
from ..core.taxonomy import answer_headers, classify_response, error_object, exhausted_status
from ..core.vocabulary import HANDSHAKE_FAILED, PRE_DISPATCH, UPGRADE_REFUSED, USAGE_LIMIT_REASONS, Verdict
from ..mitm import fallbacks
from ..mitm.attempt_maker import via_of
from ..mitm.secret_guard import SECRETS
from ..shared import Shared
from .conn import HANDSHAKE_HEADERS, HandshakeRejected, Message, WsConn
from .layer_socket import LayerSocket
from .leg import Leg
from .upstream import ConnectFailed, Target, open_upstream

log = logging.getLogger("codex_failover")


def as_frames(rejection: Rejection, first: Soonest | None = None) -> tuple[Message, ...]:
    """What the client gets on exhaustion: upstream's own messages, or a status-bearing `error`
    frame shaped like Codex's wrapped errors, telling when the pool's first credential is back."""
    if rejection.frames:
        return rejection.frames
    status = rejection.status or exhausted_status(rejection.reason)
    error = {"type": rejection.error.get("type") or "upstream_error", "code": rejection.error.get("code") or rejection.reason,
             "message": rejection.error.get("message") or f"codex-failover: {rejection.reason}"}
    if first is not None:
        error.update(time_fields(first, rejection.reason in USAGE_LIMIT_REASONS))
        error["message"] = f"{error['message']} {back_in(first)}"
    body = {"type": "error", "status": status, "error": SECRETS.mask_in(error)}  # a pooled key's echo is masked
    return ((json.dumps(body, separators=(",", ":")).encode(), True),)


# What an upgrade may fail with (anything else is a bug or a cancellation, and goes on up).
_NOT_UPGRADED = (ConnectFailed, HandshakeRejected, OSError, TimeoutError, asyncio.IncompleteReadError,
                 asyncio.LimitOverrunError, ValueError)


# The upgrade's own headers, sent on by mitmproxy's layers as the client sent them (the key, the
# version, the extensions it offered: mitmproxy negotiates the upstream's answer on both sides).
_UPGRADE_HEADERS = {b"host", b"connection", b"upgrade", b"sec-websocket-key", b"sec-websocket-version",
                    b"sec-websocket-extensions", b"sec-websocket-protocol"}


@dataclass
class Upstream:
    conn: WsConn
    cand: Candidate
    route: str  # the endpoint's label, or direct
    leg: Leg  # its flow (leg.py)

    async def send(self, message: Message) -> None:
        """A message to the upstream, recorded on its leg's flow."""
        self.leg.message(*message, from_client=True)
        await self.conn.send(message)


class Dialer:
    """Opens upstream sockets for one client socket; remembers which credentials this turn tried."""

    def __init__(self, sid: str, client_flow, shared: Shared, history: deque[str]):
        # `history` is the session's: a plain shared deque, not a callback into the session, so a
        # finished session is freed by reference counting (no cycle to wait for the collector).
        self.sid, self.shared, self.history = sid, shared, history
        self.client_flow = client_flow
        request = client_flow.request
        self.url = request.url
        self.headers = request.headers.copy()
        self.client_auth = auth_from_headers(request.headers)
        self.session = affinity_key(self.client_auth.account if self.client_auth else None,
                                    session_of(request.headers, None))  # affinity's key
        self.pinned = not assess(None, request.headers).movable  # the pin header, as on HTTP
        self.last: Rejection | None = None
        self._first: str | None = None  # the credential whose socket this turn started on
        self._loop: FailoverLoop | None = None  # this turn's, from its first dial on
        self.legs = 0  # upstream sockets tried (each a flow)

    def others_ready(self, key: str) -> bool:
        """Would a reconnect find a credential other than `key`?"""
        plan = make_plan(self.client_auth, self.shared.pool, self.shared.health, not self.pinned)
        return any(c.key != key for c in plan.candidates)

    def soonest(self) -> Soonest | None:
        """The first of this socket's credentials to come back (for an answer that none can serve)."""
        plan = make_plan(self.client_auth, self.shared.pool, self.shared.health, not self.pinned)
        return soonest(self.shared.health, plan.all_keys)

    def new_turn(self, key: str) -> None:
        """A new turn starts on the socket of credential `key` (its first attempt)."""
        self._first, self._loop = key, None

    def turn_rejected(self, rejection: Rejection) -> None:
        """The turn was rejected on its socket: its loop goes on from there (the next socket it opens
        is chosen, and waited for, knowing why: the only credential's backoff, as on HTTP)."""
        self._turn().rejected_later(rejection)

    async def open_next(self) -> Upstream | None:
        """The next candidate's socket, within this turn's attempts; None when none opens."""
        return await self._dial(self._turn())

    def home_of(self, bound: str | None) -> str:
        """The credential key a turn that may not move belongs on: the one that made its state
        (`bound`), else the client's own (planner.make_plan)."""
        return make_plan(self.client_auth, self.shared.pool, self.shared.health, movable=False, bound=bound).all_keys[0]

    async def open_home(self, bound: str | None = None) -> Upstream | None:
        """A socket on the credential a turn that may not move belongs on (`home_of`), counted
        from this turn's attempts. (Such a turn never moves, so nothing dials after it.)"""
        made = self._loop.n if self._loop is not None else int(self._first is not None)
        return await self._dial(self._new_loop(True, (), made, bound))

    def _turn(self) -> FailoverLoop:
        """This turn's loop: it goes on from the credential the turn started on (one attempt made).
        The upgrade's loop (no turn yet) never waits; a turn's waits as the HTTP path's does."""
        if self._loop is None:
            first = () if self._first is None else (self._first,)
            self._loop = self._new_loop(False, first, len(first))
        return self._loop

    def _new_loop(self, home: bool, tried: tuple[str, ...], n: int, bound: str | None = None) -> FailoverLoop:
        """A loop over the policy's candidates, or (`home`) over the client's own credential only.
        Within a turn (one has started) it waits as on HTTP: the only credential's backoff, its
        probe through an overload rest, the hold for one back within `cooldown_wait`."""
        # Closures over plain values, not bound methods: the Dialer keeps its loop, and a cycle
        # through it would keep a finished session's Dialer until the collector runs.
        client_auth, shared, session, sid, movable = self.client_auth, self.shared, self.session, self.sid, not self.pinned

        def plan() -> Plan:
            if home:
                return make_plan(client_auth, shared.pool, shared.health, movable=False, bound=bound)
            return make_plan(client_auth, shared.pool, shared.health, movable, shared.affinity.get(session))

        def tell(level: int, text: str) -> None:
            log.log(level, "[%s] %s", sid, text)

        return FailoverLoop(plan, shared.health, shared.route_health, shared.pool, handshake=True,
                            waits=self._first is not None, tried=tried, n=n, tell=tell)

    async def _dial(self, loop: FailoverLoop) -> Upstream | None:
        """Upgrades in the loop's order until one is accepted; None when the loop gives up (nothing
        left to try, or a failure that must not move: TLS verification, the client's own 401/403)."""
        try:
            while True:
                match loop.next():
                    case Try(cand, ep, _):
                        label = ep.label if ep else "direct"
                        outcome = await self._upgrade(cand, ep, label)
                        if isinstance(outcome, Upstream):
                            loop.report(SERVED)
                            return outcome
                        if loop.report(Rejected(outcome)):  # else only the endpoint failed: the next is tried
                            self._rejected(cand, label, outcome)
                    case RouteDown(cand, rejection):
                        self._rejected(cand, cand.route, rejection)
                    case Wait(seconds, why):
                        self.history.append(f"{why}: {seconds:.1f}s")
                        log.info("[%s] %s: holding the turn %.1fs", self.sid, why, seconds)
                        await asyncio.sleep(seconds)  # the session's abort closes its sockets meanwhile
                    case _:
                        return None
        except BaseException:
            loop.abandon()  # a probe that never finished must not keep the endpoint claimed
            raise

    async def _upgrade(self, cand: Candidate, ep: Endpoint | None, label: str) -> Upstream | Rejection:
        """The upgrade through one endpoint (None: direct): the socket, or why not. It is an attempt
        on mitmproxy's layers (layer_socket.py), or with the fallback the gate's own (leg.py); either
        way every addon's hooks see it first, and where they send it is where it goes."""
        if not fallbacks.seam_holds("wsleg"):
            return await self._upgrade_own(cand, ep, label)
        url, headers, label_n, title = self._leg_request(cand)
        sock = LayerSocket(self.client_flow, url, headers, label_n, title, self.shared.engine)
        sock.account, sock.endpoint = cand.key, ep
        sock.verdict = lambda exc: self._verdict(exc, self._rejection_of(exc), label)
        try:
            sock.start(await via_of(ep, self.shared.bridges))
            await sock.opened(self.shared.pool.policy.connect_timeout)
        except BaseException as exc:
            if not isinstance(exc, _NOT_UPGRADED):
                await asyncio.shield(sock.stop())
                raise
            return self._rejection_of(exc)
        return Upstream(sock, cand, label, sock)  # type: ignore[arg-type]

    @staticmethod
    def _verdict(exc: BaseException, rejection: Rejection, label: str) -> tuple[str, str]:
        """A failed upgrade's mark and line on its flow."""
        if isinstance(exc, HandshakeRejected):
            return story.REJECTED, f"upgrade rejected ({rejection.reason}) via {label}"
        return story.NO_CONNECTION, f"upgrade failed ({rejection.reason}) via {label}"

    def _rejection_of(self, exc: BaseException) -> Rejection:
        """What the failover loop learns from a failed upgrade (HandshakeRejected: its classified body)."""
        match exc:
            case ConnectFailed():
                return Rejection(exc.kind, None, {"message": str(exc)})
            case HandshakeRejected():
                return self._upgrade_rejected(exc)
        message = f"{type(exc).__name__}: {exc}"
        return Rejection(HANDSHAKE_FAILED, None, {"message": message})

    async def _upgrade_own(self, cand: Candidate, ep: Endpoint | None, label: str) -> Upstream | Rejection:
        """The fallback: the gate dials, speaks TLS and WebSocket itself (upstream.py, conn.py)."""
        leg, conn = self._leg(cand), None
        try:
            await leg.ask()
            conn = await self._connect(leg, ep)
            conn.on_end = leg.end
            await leg.accepted(conn.response_headers)
        except BaseException as exc:
            return await self._not_upgraded(leg, conn, label, exc)
        return Upstream(conn, cand, label, leg)

    async def _not_upgraded(self, leg: Leg, conn: WsConn | None, label: str, exc: BaseException) -> Rejection:
        """Why an upgrade did not give a socket, on its leg's flow too. A cancelled dial (the client
        left) closes what it opened and ends its flow, then goes on being cancelled."""
        if conn is not None:
            conn.close(1001)
        if not isinstance(exc, _NOT_UPGRADED):
            leg.abandoned()
            raise exc
        rejection = self._rejection_of(exc)
        _, line = self._verdict(exc, rejection, label)
        if isinstance(exc, HandshakeRejected):
            await leg.rejected(exc.status, exc.headers, exc.body, line)
        else:
            await leg.failed(str(rejection.error["message"]), line)
        return rejection

    def _leg_request(self, cand: Candidate) -> tuple[str, http.Headers, str, str]:
        """The upgrade's URL and headers for `cand` (its credential swapped in), its label and title."""
        headers = self.headers.copy()
        if cand.auth is not None:
            swap_credential(headers, cand.auth, moved=not cand.is_client)
        for name in [k for k in headers if k.lower() in HANDSHAKE_HEADERS or k.lower() == PIN_HEADER]:
            headers.pop(name, None)
        if fallbacks.seam_holds("wsleg"):  # mitmproxy's layers send the upgrade's own headers (wsproto makes its own)
            for name, value in self.headers.fields:
                if name.lower() in _UPGRADE_HEADERS:
                    headers.add(name.decode("latin-1"), value.decode("latin-1"))
        url = cand.base_url + "/responses" if cand.base_url else self.url
        self.legs += 1
        return (url, headers, f"{self.sid}#{self.legs}",
                f"codex-failover websocket {self.sid}, upstream socket {self.legs}: {cand.name}")

    def _leg(self, cand: Candidate) -> Leg:
        url, headers, label, title = self._leg_request(cand)
        return Leg(self.client_flow, url, headers, label, title)

    async def _connect(self, leg: Leg, ep: Endpoint | None) -> WsConn:
        flow = leg.flow
        if flow.response is not None:  # an addon answered the upgrade itself
            raise HandshakeRejected(flow.response.status_code, list(flow.response.headers.fields),
                                    flow.response.raw_content or b"")
        if flow.error is not None:
            raise ConnectFailed(PRE_DISPATCH, f"an addon ended the upgrade: {flow.error.msg}")
        req = flow.request
        target = Target(req.scheme in ("https", "wss"), req.host, req.port, req.path or "/")
        policy = self.shared.pool.policy
        deflate = "permessage-deflate" in self.headers.get("sec-websocket-extensions", "")
        # The upgrade's answer is bounded by connect_timeout too: a silent upstream must reach
        # Codex as a quick 426 (SSE), not after its own handshake timeout and reconnect attempts.
        return await open_upstream(target, leg.wire_headers(), ep, self.shared.bridges, self.shared.upstream_tls,
                                   policy.connect_timeout, policy.connect_timeout, deflate)

    def _upgrade_rejected(self, exc: HandshakeRejected) -> Rejection:
        verdict = classify_response(exc.status, exc.body, self.shared.rules, answer_headers(exc.headers))
        retry_after = next((v.decode("latin-1") for k, v in exc.headers if k.lower() == b"retry-after"), None)
        # Not a known rejection (e.g. an upstream without the WebSocket transport): Codex can use SSE.
        reason = verdict.reason if verdict.verdict == Verdict.FAILOVER else UPGRADE_REFUSED
        return Rejection(reason, exc.status, dict(verdict.error or error_object(exc.body)), retry_after=retry_after)

    def _rejected(self, cand: Candidate, label: str, rejection: Rejection) -> None:
        self.last = rejection
        if own_refusal(rejection.reason, cand):
            self.shared.feedback.client_refused(self.client_auth)
        if cools(cand, rejection):
            self.shared.feedback.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                                       rejection.retry_after, self.shared.pool.policy, f"[{self.sid}] ")
        status = f" HTTP {rejection.status}" if rejection.status else ""
        detail = str(rejection.error.get("message") or "")[:200]
        line = f"{cand.name} via {label}: upgrade failed ({rejection.reason}{status}){': ' + detail if detail else ''}"
        self.history.append(line)
        log.info("[%s] %s", self.sid, line)
