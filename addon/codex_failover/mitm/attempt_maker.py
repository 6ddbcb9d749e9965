"""Builds each attempt of one held request: the client's request with the candidate's credential,
base URL and (moved) body, and the way to its upstream; dials the next candidate's connection ahead
of need (docs/architecture.md#warm-connections)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from mitmproxy import http

from ..core.body_edit import remove_members
from ..core.codex_request import COMPACT, asks_to_stream, swap_credential
from ..core.planner import Candidate, Plan
from ..core.policy import PoolConfig
from ..core.replay_safety import PIN_HEADER, MovePolicy, removals
from ..core.routes import Endpoint
from ..core.warm_book import WarmKey
from ..shared import Shared
from . import bounded_body
from .attempt import Attempt, copy_request
from .direct import DirectAttempt
from .held_client import HeldClient


async def via_of(ep: Endpoint | None, bridges):
    """mitmproxy's per-connection upstream proxy for `ep` (SOCKS goes through a local bridge)."""
    if ep is not None and ep.is_socks:
        return ("http", await bridges.address(ep))
    return proxy_via(ep)


def proxy_via(ep: Endpoint | None):
    """`via_of` for no endpoint or an HTTP proxy (nothing to wait for)."""
    return None if ep is None else (ep.scheme, (ep.host, ep.port))


class AttemptMaker:
    """The attempts of one request (see the module's docstring): `original` as the client sent it,
    `body` its parsed JSON, `move` what may change on another credential, `pool` the request's."""

    def __init__(self, request_id: str, flow: http.HTTPFlow, client: HeldClient, original: http.Request, body: object,
                 move: MovePolicy, shared: Shared, pool: PoolConfig):
        self.request_id, self.flow, self.client, self.original = request_id, flow, client, original
        self.body, self.move, self.shared, self.pool = body, move, shared, pool
        self.bodies: dict[tuple, bytes] = {}  # what each kind of attempt sends, built once

    def make(self, cand: Candidate, n: int, ep: Endpoint | None = None) -> Attempt:
        """Attempt `n` on `cand` (through `ep`). The first one, on the client's own credential, direct,
        to the client's own URL with its own body, rides the client's stream (direct.py)."""
        content = self._body_for(cand)
        label = f"{self.request_id}#{n}"
        if (n == 1 and cand.is_client and ep is None and not cand.base_url and content is None
                and PIN_HEADER not in self.original.headers and self.client.can_go_direct):
            # The client's own request as it came: the wire gets it, the client's flow shows it.
            attempt: Attempt = DirectAttempt(self.flow, label, n, self.client.hop, self.original)
        else:
            req = copy_request(self.original)
            if cand.base_url:
                req.url = cand.base_url + (COMPACT if self.original.path.split("?", 1)[0].endswith(COMPACT) else "/responses")
            if cand.auth is not None:
                swap_credential(req.headers, cand.auth, moved=not cand.is_client)
            if content is not None:
                req.content = content
            req.headers.pop(PIN_HEADER, None)
            attempt = self.shared.engine.attempt(self.flow, req, label, n)
        attempt.dial_timeout = self.pool.policy.connect_timeout
        attempt.account = cand.key
        attempt.wants_stream = asks_to_stream(self.body)
        return attempt

    def _body_for(self, cand: Candidate) -> bytes | None:
        """The body an attempt on `cand` sends, when it differs from the client's: without the
        encrypted reasoning that credential did not make, and on another account without the
        client's turn state. Cut from the client's own bytes, nothing else changed (body_edit)."""
        if not isinstance(self.body, dict):
            return None
        strip = tuple(self.move.strips(cand.key, cand.is_client))
        foreign = not cand.is_client
        cuts = removals(self.body, list(strip), foreign)
        if not cuts:
            return None
        key = (strip, foreign)
        if key not in self.bodies:
            # Within failover_max_body decoded (the request hook held it so): bounded all the same.
            decoded = bounded_body.content_now(self.original, bounded_body.limit).content
            self.bodies[key] = remove_members(decoded or b"", self.body, cuts)
        return self.bodies[key]

    def let_go(self) -> None:
        """No attempt follows (a commit, or the run's end): the parsed body and the moved bodies go.
        A committed stream lives as long as its answer (minutes, for a long Codex turn), and Codex's
        body is the whole conversation: 64 streams kept 64 parsed conversations (issue 45's budget)."""
        self.body, self.bodies = None, {}

    async def via(self, ep: Endpoint | None):
        return await via_of(ep, self.shared.bridges)

    def prewarm_next(self, plan: Plan | None, current: Candidate) -> None:
        """Dial the connection the next candidate (by the plan) would use, if none is open or
        underway, so a failover pays no handshake. (A task only for a SOCKS route's bridge.)"""
        following = [c for c in plan.candidates if c.key != current.key] if plan is not None else []
        if not following:
            return
        cand = following[0]
        if cand.base_url:
            parts = urlsplit(cand.base_url)
            scheme, host, port = parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        else:
            scheme, host, port = self.original.scheme, self.original.host, self.original.port
        if not host:
            return  # (a base URL without a host: its attempts fail by themselves)
        endpoints = self.pool.routes.get(cand.route) or [None]
        ep = next((e for e in endpoints if e is None or self.shared.route_health.healthy(e)), None)
        if ep is None and endpoints != [None]:
            return
        if ep is not None and ep.is_socks:
            task = asyncio.get_running_loop().create_task(self._prewarm(cand, scheme, host, port, ep))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # best effort: never an error
        else:
            self.shared.engine.prewarm(WarmKey(scheme, host, port, proxy_via(ep), cand.key), ep,
                                       self.pool.policy.connect_timeout)

    async def _prewarm(self, cand: Candidate, scheme: str, host, port, ep: Endpoint) -> None:
        via = await self.via(ep)
        self.shared.engine.prewarm(WarmKey(scheme, host, port, via, cand.key), ep, self.pool.policy.connect_timeout)
