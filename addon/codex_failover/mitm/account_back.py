"""Cooldowns that end when the account is back (core/cooldown_end.py decides): a nested addon
of FailoverAddon that watches Codex's reset-credit redemptions go by, re-checks long usage-limit cooldowns through each
account's own usage endpoint, and ends one by `failover.reset NAME` (the addon's command). Each ending is one log line
and shows on the status page."""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import unquote, urlsplit

from mitmproxy import http

from ..config import PoolConfig
from ..core import own_tokens
from ..core.auth import CHATGPT, AuthMaterial, auth_from_headers
from ..core.client_access import is_loopback_host
from ..core.client_boundary import STATUS_HEADER, status_write_refusal
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
from ..core.planner import CLIENT, client_key
from ..core.seen_clients import MAX_SEEN, label
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
        # The clients' own ChatGPT logins, by health key: a token (and base URL) the upstream accepted
        # and the newest one seen, so the re-check can ask its usage endpoint too (core/own_tokens.py:
        # a token claiming another's account never displaces it). Memory only, never stored or shown.
        self.own: own_tokens.OwnTokens[tuple[AuthMaterial, str]] = own_tokens.OwnTokens(MAX_SEEN)

    def reads_answer_of(self, flow) -> bool:
        """Is `flow` a reset credit's redemption whose answer this reads whole?"""
        return flow.id in self._sent

    def saw_client(self, auth: AuthMaterial, url: str, pooled: str | None = None) -> None:
        """A client's own credential on a model request to `url` (`pooled`: the pool's name for it,
        re-checked as a pooled credential)."""
        if auth.kind != CHATGPT or pooled is not None:
            return
        parts = urlsplit(url)
        path = parts.path.rstrip("/")
        for tail in ("/responses/compact", "/responses"):
            path = path.removesuffix(tail)
        self.own.saw(client_key(auth), (auth, f"{parts.scheme}://{parts.netloc}{path}"))

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
        """`curl -x 127.0.0.1:8080 -X POST -H 'X-Codex-Failover: 1' http://codex-failover.status/reset/NAME`,
        from this machine only, never a web page's (core/client_boundary.status_write_refusal)."""
        peer = flow.client_conn.peername[0] if flow.client_conn.peername else None
        if not flow.request.path.startswith("/reset/"):
            return _json(404, {"error": "POST /reset/NAME ends credential NAME's cooldown; GET / is the status"})
        if peer is None or not is_loopback_host(peer.removeprefix("::ffff:")):
            return _json(403, {"error": "ending a cooldown is for this machine only (loopback)"})
        if (why := status_write_refusal(flow.request.headers)) is not None:
            log.info("codex-failover: a reset from the status page refused: %s", why)
            return _json(403, {"error": f"reset refused: {why}; send `{STATUS_HEADER}: 1` from this machine, "
                                        "not from a web page"})
        found, text = self.reset(unquote(flow.request.path.removeprefix("/reset/")))
        if not found:
            return _json(404, {"error": text, "names": self.names()})
        return _json(200, {"result": text})

    def reset_by_name(self, name: str) -> str:
        return self.reset(name)[1]

    def names(self) -> list[str]:
        """What a reset may name: the pool's credentials, `client` (every client's own), and each
        client credential seen by its label's tail (`…1a2b` as `1a2b`, `key #1a2b3c4d` as `1a2b3c4d`)."""
        clients = [tail for _, name, *_ in self.owner.seen_clients.recent() if (tail := _tail(name))]
        return [*(c.name for c in self._pool().credentials), CLIENT, *clients]

    def _client_keys(self, name: str) -> list[str]:
        """The health keys a reset of `name` ends for the clients' own credentials."""
        health = self._health()
        if name == CLIENT:
            seen = [key for key, *_ in self.owner.seen_clients.recent()]
            return list(dict.fromkeys([*seen, *(k for _, k in health.keys() if k.startswith(f"{CLIENT}:"))]))
        wanted = name.removeprefix("client ").strip()
        return [key for key, shown, *_ in self.owner.seen_clients.recent()
                if wanted and wanted in (shown, _tail(shown))]

    def reset(self, name: str) -> tuple[bool, str]:
        """(whether `name` names anything, the line). Ends credential NAME's cooldown or out-of-rotation
        mark: a pooled credential's, or with `client` (or a client's label) the clients' own."""
        health = self._health()
        if any(c.name == name for c in self._pool().credentials):
            ended = self.ends.end(health, name, BY_HAND)
            if ended is None:
                text = f"codex-failover: credential {name} was not cooling or out of rotation; nothing to end"
                log.info(text)
                return True, text
            return True, self._ended(name, name, ended)
        keys = self._client_keys(name)
        if not keys and name != CLIENT:
            text = (f"codex-failover: no credential named {name!r} (known: {', '.join(self.names())})")
            log.warning(text)
            return False, text
        lines = [self._ended(key, f"client {self._label(key)}", ended) for key in keys
                 if (ended := self.ends.end(health, key, BY_HAND)) is not None]
        if not lines:
            text = f"codex-failover: the client's own credential ({name}) was not cooling or out of rotation; nothing to end"
            log.info(text)
            return True, text
        return True, "\n".join(lines)

    def _label(self, key: str) -> str:
        shown = next((name for k, name, *_ in self.owner.seen_clients.recent() if k == key), None)
        return shown or f"key #{key.removeprefix(CLIENT + ':')[:8]}"

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
        """Ask the usage endpoint of each account cooling for a usage limit whose re-check is due:
        the pool's (their own token and route) and the clients' own (the token of their last
        request, directly, as the client itself goes)."""
        pool, health = self._pool(), self._health()
        self.recheck.every = pool.policy.usage_recheck
        creds = {c.name: c for c in pool.credentials if c.kind == CHATGPT}
        for key in self.recheck.due(health, [*creds, *self.own]):
            self.recheck.checked(key, health.now())
            if key in creds:
                cred = creds[key]
                endpoints = pool.routes.get(cred.route) or (None,)
                await self._ask(key, key, cred.auth, cred.base_url, endpoints[0], cred.max_usage_percent)
                continue
            for held in self.own.to_try(key):  # the newest token seen first, then the one the upstream accepted
                status = await self._ask(key, f"client {label(held[0])}", held[0], held[1], None, 100.0)
                if status is not None:
                    self.own.answered(key, held, own_tokens.verdict(status))
                if status is None or own_tokens.verdict(status) != own_tokens.REFUSED:
                    break

    async def _ask(self, key: str, name: str, auth: AuthMaterial, base: str, via, full_at: float) -> int | None:
        """One usage re-check: the status it answered (None: no answer), the cooldown ended on headroom."""
        pool, health = self._pool(), self._health()
        headers = {**auth.headers(), **auth.account_headers()}
        try:
            status, doc = await get_json(usage_url(base), headers, via, self._shared().bridges,
                                         self._shared().upstream_tls, pool.policy.connect_timeout)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            log.info("codex-failover: credential %s: usage re-check failed (%s); next in %ds", name,
                     type(exc).__name__, pool.policy.usage_recheck)
            return None
        if not 200 <= status < 300:
            log.info("codex-failover: credential %s: usage re-check answered HTTP %d", name, status)
            return status
        windows = usage_windows(doc)
        if windows:
            self.usage.record(key, windows, full_at)
        if usage_has_headroom(doc, full_at):
            self._ended(key, name, self.ends.end(health, key, RECHECKED, usage_only=True))
        return status

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


def _tail(shown: str) -> str:
    """What a reset may name a client credential by: its label's tail (`account …1a2b` -> `1a2b`)."""
    return shown.rpartition("…")[2].rpartition("#")[2].strip()


def _json(status: int, doc: dict) -> http.Response:
    return http.Response.make(status, json.dumps(doc).encode() + b"\n", {"content-type": "application/json"})
