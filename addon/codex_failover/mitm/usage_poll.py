"""Asks each account's usage endpoint while the dashboard is open (core/usage_poll.py decides which
and when): the pooled ChatGPT credentials with their own tokens, and each client's own ChatGPT account
with the token of its last request, which account_back.py keeps in memory only (never written, never
logged). The answers go to the usage book, as the usage re-check's do."""

from __future__ import annotations

import asyncio
import logging
import time

from ..core import own_tokens
from ..core.auth import CHATGPT, AuthMaterial
from ..core.cooldown_end import usage_url, usage_windows
from ..core.seen_clients import label
from ..core.usage_poll import UsagePoll
from ..net.usage_fetch import get_json

log = logging.getLogger("codex_failover")
TICK = 15.0  # seconds between two looks at what is due


class UsagePoller:
    def __init__(self, owner):
        self.owner = owner  # the FailoverAddon: its pool, health, usage book, shared parts
        self.poll = UsagePoll()
        self.notes: dict[str, str] = {}  # row key (credential name or label) -> what the last ask said
        self.task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._rejections = 0  # attempts rejected so far (the activity's count): more means a rejection came

    def watched(self) -> None:
        self.poll.watched(time.time())
        self.start()
        self._wake.set()

    def start(self) -> None:
        if self.task is None or self.task.done():
            try:
                self.task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:  # no loop (unit tests)
                self.task = None

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception as exc:  # noqa: BLE001 - the loop outlives one bad answer
                log.warning("codex-failover: dashboard usage poll failed: %s: %s", type(exc).__name__, exc)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), TICK)
            except TimeoutError:
                pass

    def _accounts(self) -> dict[str, tuple[str, AuthMaterial, str, object]]:
        """health key -> (row key, auth, base URL, route endpoint) of every account with a usage endpoint."""
        pool = self.owner.pool
        out: dict[str, tuple[str, AuthMaterial, str, object]] = {}
        for cred in pool.credentials:
            if cred.kind == CHATGPT:
                out[cred.name] = (cred.name, cred.auth, cred.base_url, (pool.routes.get(cred.route) or (None,))[0])
        # The clients' own ChatGPT accounts, each with the token of its last request (account_back.py keeps
        # them, in memory only, for its usage re-check).
        own = self.owner.back.own
        for key in own:
            if tried := own.to_try(key):  # the newest token seen first, then the one the upstream accepted
                auth, base_url = tried[0]
                out.setdefault(key, (label(auth), auth, base_url, None))
        return out

    async def round(self) -> None:
        health, now = self.owner.health, time.time()
        rejections = sum(self.owner.activity.rejections.values())
        if rejections > self._rejections:
            self._rejections = rejections
            self.poll.rejection(now)
        accounts = self._accounts()
        self.poll.forget(accounts)
        rows = {row for row, *_ in accounts.values()}
        for row in [r for r in self.notes if r not in rows]:  # bounded by the pool and the accounts kept
            del self.notes[row]

        def state(key: str, auth: AuthMaterial) -> str:
            if auth.expires_at is not None and auth.expires_at <= now:
                return "expired"
            return health.state(key).status

        for key in self.poll.due([(k, state(k, a[1])) for k, a in accounts.items()], now):
            row, auth, base_url, via = accounts[key]
            self.poll.asked(key, time.time())
            await self._ask(key, row, auth, base_url, via)

    async def _ask(self, key: str, row: str, auth: AuthMaterial, base_url: str, via) -> None:
        shared = self.owner.shared()
        try:
            status, doc = await get_json(usage_url(base_url), {**auth.headers(), **auth.account_headers()}, via,
                                         shared.bridges, shared.upstream_tls, self.owner.pool.policy.connect_timeout)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            self.notes[row] = f"usage could not be asked at {time.strftime('%H:%M')} ({type(exc).__name__})"
            return
        if all(c.name != key for c in self.owner.pool.credentials):  # a client's own: the upstream judged its token
            self.owner.back.own.answered(key, (auth, base_url), own_tokens.verdict(status))
        if not 200 <= status < 300:
            self.notes[row] = f"usage answered HTTP {status} at {time.strftime('%H:%M')}"
            return
        windows = usage_windows(doc)
        if windows:
            self.owner.usage.record(key, windows)
        self.notes[row] = f"usage asked at {time.strftime('%H:%M')}" if windows else "its usage answer has no windows"
