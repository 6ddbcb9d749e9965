"""Cooldowns that end when the account is back (core/cooldown_end.py decides): a part of the addon
(parts.py) that watches Codex's reset-credit redemptions go by, re-checks long usage-limit cooldowns through each
account's own usage endpoint, and ends one by `failover.reset NAME` (the addon's command). Each ending is one log line
and shows on the status page."""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import unquote

from mitmproxy import http

from ..config import PoolConfig
from ..core.auth import CHATGPT, AuthMaterial, auth_from_headers
from ..core.client_access import is_loopback_host
from ..core.cooldown_end import (
    BY_HAND,
    RECHECKED,
    REDEEMED,
    CooldownEnds,
    Ended,
    UsageRecheck,
    redeems_reset_credit,
    usage_has_headroom,
    usage_url,
    usage_windows,
)
from ..core.health import Health
from ..core.planner import client_key
from ..core.usage import UsageBook
from ..net.usage_fetch import get_json
from .attempt import ATTEMPT_TAG

log = logging.getLogger("codex_failover")


class AccountBack:
    def __init__(self, owner):
        """`owner`: the FailoverAddon, whose pool (it changes on reload), health, usage and shared parts
        this reads."""
        self.owner = owner
        self._sent: dict[str, AuthMaterial] = {}  # flow id -> the credential of a redemption on its way
        self.ends = CooldownEnds()
        self.recheck = UsageRecheck()
        self.task: asyncio.Task | None = None

    def _pool(self) -> PoolConfig:
        return self.owner.pool

    def _health(self) -> Health:
        return self.owner.health

    @property
    def usage(self) -> UsageBook:
        return self.owner.usage

    def _shared(self):
        return self.owner.shared()

    # -- a redeemed reset credit ---------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A redemption's credential, kept in memory (never in the flow) until its answer: the
        request's own headers are redacted once it left (passthrough_redact.py)."""
        req = flow.request
        if not flow.is_replay and ATTEMPT_TAG not in flow.metadata and redeems_reset_credit(req.method, req.path, 200):
            if (auth := auth_from_headers(req.headers)) is not None:
                self._sent[flow.id] = auth

    def error(self, flow: http.HTTPFlow) -> None:
        self._sent.pop(flow.id, None)

    def response(self, flow: http.HTTPFlow) -> None:
        auth = self._sent.pop(flow.id, None)
        if auth is None or flow.response is None:
            return
        req = flow.request
        if not redeems_reset_credit(req.method, req.path, flow.response.status_code):
            return
        pooled = next((c.name for c in self._pool().credentials if c.auth.account == auth.account), None)
        key = pooled or client_key(auth)
        self._ended(key, pooled or f"client key #{auth.fingerprint[:8]}",
                    self.ends.end(self._health(), key, REDEEMED, usage_only=True))

    # -- by hand ---------------------------------------------------------------------------

    def reset_from_status_page(self, flow: http.HTTPFlow) -> http.Response:
        """`curl -x 127.0.0.1:8080 -X POST http://codex-failover.status/reset/NAME`, from this machine only."""
        peer = flow.client_conn.peername[0] if flow.client_conn.peername else None
        if not flow.request.path.startswith("/reset/"):
            return _json(404, {"error": "POST /reset/NAME ends credential NAME's cooldown; GET / is the status"})
        if peer is None or not is_loopback_host(peer.removeprefix("::ffff:")):
            return _json(403, {"error": "ending a cooldown is for this machine only (loopback)"})
        return _json(200, {"result": self.reset_by_name(unquote(flow.request.path.removeprefix("/reset/")))})

    def reset_by_name(self, name: str) -> str:
        key = name if any(c.name == name for c in self._pool().credentials) else None
        if key is None:
            text = f"codex-failover: no credential named {name!r} in the pool"
            log.warning(text)
            return text
        ended = self.ends.end(self._health(), key, BY_HAND)
        if ended is None:
            text = f"codex-failover: credential {name} was not cooling or out of rotation; nothing to end"
            log.info(text)
            return text
        return self._ended(key, name, ended)

    # -- the usage re-check ----------------------------------------------------------------

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while True:
            every = self._pool().policy.usage_recheck
            await asyncio.sleep(min(30.0, every / 2) if every > 0 else 30.0)
            try:
                await self.check_due()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad answer
                log.warning("codex-failover: usage re-check failed: %s: %s", type(exc).__name__, exc)

    async def check_due(self) -> None:
        pool, health = self._pool(), self._health()
        self.recheck.every = pool.policy.usage_recheck
        creds = {c.name: c for c in pool.credentials if c.kind == CHATGPT}
        for key in self.recheck.due(health, creds):
            cred = creds[key]
            self.recheck.checked(key, health.now())
            endpoints = pool.routes.get(cred.route) or (None,)
            headers = {**cred.auth.headers(), **cred.auth.account_headers()}
            try:
                status, doc = await get_json(usage_url(cred.base_url), headers, endpoints[0], self._shared().bridges,
                                             self._shared().upstream_tls, pool.policy.connect_timeout)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
                log.info("codex-failover: credential %s: usage re-check failed (%s); next in %ds", key,
                         type(exc).__name__, pool.policy.usage_recheck)
                continue
            if not 200 <= status < 300:
                log.info("codex-failover: credential %s: usage re-check answered HTTP %d", key, status)
                continue
            windows = usage_windows(doc)
            if windows:
                self.usage.record(key, windows, cred.max_usage_percent)
            if usage_has_headroom(doc, cred.max_usage_percent):
                self._ended(key, key, self.ends.end(health, key, RECHECKED, usage_only=True))

    # -- the one log line --------------------------------------------------------------------

    def _ended(self, key: str, name: str, ended: Ended | None) -> str:
        if ended is None:
            return f"codex-failover: credential {name}: nothing to end"
        self.usage.forget(key)  # its old full windows no longer hold (the state keeper hears of both)
        text = f"codex-failover: credential {name}: cooldown ended ({ended.how}; was {ended.was}); in rotation again"
        log.warning(text)
        return text

    def report(self) -> dict[str, Ended]:
        return self.ends.last


def _json(status: int, doc: dict) -> http.Response:
    return http.Response.make(status, json.dumps(doc).encode() + b"\n", {"content-type": "application/json"})
