"""Codex's usage question (`GET …/wham/usage`, `…/api/codex/usage`) when its own account is limited:
answered with the usage of the pooled credential its next turn would be placed on, asked with that
credential's own token (core/usage_view.py decides). Only on a model host or a pool base URL's host,
only for the user's own programs (the rule model requests follow: not a browser's, not another
user's), and only the fields Codex reads. A nested addon of FailoverAddon; the own
account's answer passes as it is whenever that account can send."""

from __future__ import annotations

import asyncio
import json
import logging

from mitmproxy import http

from ..core.affinity import session_of
from ..core.auth import CHATGPT, AuthMaterial, auth_from_headers
from ..core.cooldown_end import usage_has_headroom, usage_url, usage_windows
from ..core.planner import client_key, make_plan
from ..core.usage_view import UsageCache, is_usage_request, own_can_send, pooled_view
from ..net.usage_fetch import get_json
from . import bounded_body
from .attempt import ATTEMPT_TAG

log = logging.getLogger("codex_failover")
HEADER = "x-codex-failover-usage"  # on a rewritten answer: whose usage it is
USAGE_CAP = 1024 * 1024  # a usage answer is a few KiB


class UsageAnswer:
    def __init__(self, owner):
        self.owner = owner  # the FailoverAddon: its pool, health, affinity, clients, shared parts
        self.cache = UsageCache()
        self._asking: dict[str, AuthMaterial] = {}  # flow id -> the credential asking, while its answer comes
        self._told: dict[str, str] = {}  # own key -> the credential its last answer came from (one log line a change)

    def reads_answer_of(self, flow) -> bool:
        """Is `flow` a usage question whose answer this reads whole?"""
        return flow.id in self._asking

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """The asking credential, kept in memory (never in the flow) until the answer: the request's
        own headers are redacted once it left (passthrough_redact.py)."""
        req, owner = flow.request, self.owner
        if flow.is_replay or ATTEMPT_TAG in flow.metadata or not is_usage_request(req.method, req.path):
            return
        if not owner.matcher.is_model_host(req.host, req.port):
            return  # another host's (a web page's own server, say): its answer is its own, never the pool's
        if not owner.clients.allows(flow.client_conn.peername[0] if flow.client_conn.peername else None):
            return
        own = auth_from_headers(req.headers)
        if own is not None and not owner.boundary.passed_by(flow, own):  # never lent: a browser's, another user's
            self._asking[flow.id] = own

    def error(self, flow: http.HTTPFlow) -> None:
        self._asking.pop(flow.id, None)

    def response(self, flow: http.HTTPFlow):
        """(An awaitable for a usage answer it waits for only: any other flow's hook needs no coroutine.)"""
        own = self._asking.pop(flow.id, None)
        if own is None or flow.response is None:
            return None
        return self._answered(flow, own)

    async def _answered(self, flow: http.HTTPFlow, own: AuthMaterial) -> None:
        req, owner, response = flow.request, self.owner, flow.response
        assert response is not None  # (the response hook)
        pool, health = owner.pool, owner.health
        pooled_own = next((c for c in pool.credentials if c.auth.account == own.account), None)
        own_key = pooled_own.name if pooled_own else client_key(own)
        status = response.status_code
        if own_can_send(status, await _doc(response), health.ready(own_key)):
            return
        plan = make_plan(own, pool, health, True, owner.affinity.get(session_of(req.headers, None)))
        cand = next((c for c in plan.candidates if not c.is_client and c.auth is not None and c.auth.kind == CHATGPT), None)
        if cand is None:
            return
        doc = self.cache.get(cand.key) or await self._ask(cand.name)
        if doc is None:
            return
        response.status_code = 200
        response.headers["content-type"] = "application/json"
        response.headers[HEADER] = cand.name
        response.content = json.dumps(pooled_view(doc, cand.name, status)).encode()
        if self._told.get(own_key) != cand.name:
            self._told[own_key] = cand.name
            log.info("codex-failover: usage asked for a limited account: answered with credential %s's "
                     "(its next turn goes there)", cand.name)

    async def _ask(self, name: str) -> dict | None:
        """The pooled credential's own usage answer, if it has headroom (cached briefly)."""
        pool = self.owner.pool
        cred = next((c for c in pool.credentials if c.name == name), None)
        if cred is None:
            return None
        shared = self.owner.shared()
        endpoints = pool.routes.get(cred.route) or (None,)
        try:
            status, doc = await get_json(usage_url(cred.base_url), {**cred.auth.headers(), **cred.auth.account_headers()},
                                         endpoints[0], shared.bridges, shared.upstream_tls, pool.policy.connect_timeout)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            log.info("codex-failover: credential %s: its usage could not be asked (%s)", name, type(exc).__name__)
            return None
        if not 200 <= status < 300 or not isinstance(doc, dict) or usage_has_headroom(doc, cred.max_usage_percent) is False:
            return None
        self.owner.usage.record(name, usage_windows(doc), cred.max_usage_percent)
        self.cache.put(name, doc)
        return doc


async def _doc(response: http.Response) -> object:
    """The upstream's usage answer, decoded bounded (bounded_body.py): past USAGE_CAP it is unreadable."""
    try:
        return json.loads((await bounded_body.content(response, USAGE_CAP)).content or b"")
    except ValueError:
        return None
