"""Pooled ChatGPT logins refresh themselves (core/token_refresh.py decides when and what an answer
means): a part of the addon that, on the addon's once-a-second look at its files and on the
account-back loop, starts the refreshes that are due, one per account at a time.

A refresh: a claim in a shared store (Redis: one proxy per account at a time), the auth file's
lock, the file read again (someone else may have refreshed: then that is adopted), the POST to the
token endpoint through the credential's own route (net/usage_fetch.post_json), and the new tokens
written back to the same file (auth_refresh.py), then in force for the next attempt. One log line
per refresh, never a token nor what the endpoint answered beyond a known error code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from dataclasses import replace
from typing import Protocol

from .. import auth_refresh
from ..core.auth import CHATGPT, AuthError, AuthMaterial, auth_from_document
from ..core.health import OUT, Health
from ..core.policy import Credential, PoolConfig
from ..core.token_expiry import login_command
from ..core.token_refresh import (
    AFTER_401,
    ANSWER_TIMEOUT,
    CLAIM_TTL,
    REFUSED_AGAIN,
    Outcome,
    Permanent,
    Refreshed,
    Refreshes,
    Reused,
    Snapshot,
    judge,
    merge,
    reason_due,
    request_doc,
    same_login,
)
from ..net.usage_fetch import NoAnswer, post_json
from ..shared import Shared
from ..state_keeper import StateKeeper
from ..ws.upstream import ConnectFailed
from .file_watch import FileWatch

log = logging.getLogger("codex_failover")
EVERY = 30.0  # seconds between looks while no request comes


def refused_401(reason: str | None) -> bool:
    """An out-of-rotation mark a pooled credential's 401 left (pool_feedback.py's words)."""
    return bool(reason) and str(reason).startswith("HTTP 401")


class Owner(Protocol):
    """What a refresh reads and writes of the addon it is part of (mitm/addon.py's FailoverAddon)."""

    pool: PoolConfig  # the pool in force: a refreshed credential's new tokens replace its old ones there
    health: Health  # a credential back in rotation, or out until a new login
    files: FileWatch  # the auth watch, told of the file the refresh wrote
    keeper: StateKeeper | None  # its store's claims keep a refresh to one proxy

    def shared(self) -> Shared:
        """The proxy's shared parts (the routes' bridges and upstream TLS, for the exchange)."""


class TokenRefresher:
    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.book = Refreshes()
        self.me = uuid.uuid4().hex  # this proxy, in a shared store's claims
        self.tasks: dict[str, asyncio.Task] = {}  # account -> its refresh under way
        self.loop: asyncio.Task | None = None
        self._checked = 0.0
        self.sleep = asyncio.sleep  # (a test waits no real seconds)

    def start(self) -> None:
        """Look every EVERY seconds too, so a pool nobody uses for a while stays fresh."""
        if self.loop is None or self.loop.done():
            self.loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.check(force=True)  # at start too: a login that ran out while the proxy was off
            await asyncio.sleep(EVERY)

    def check(self, force: bool = False) -> None:
        """Start each refresh that is due (from a running loop; at most once a second, cheap when
        none is)."""
        now_m = time.monotonic()
        if not force and now_m - self._checked < 1.0:
            return
        self._checked = now_m
        if not self._enabled():
            return
        pool, health, now = self.owner.pool, self.owner.health, time.time()
        for cred in pool.credentials:
            if cred.kind != CHATGPT or not cred.auth_file or not cred.auth.refreshable:
                continue
            state = health.state(cred.name)
            reason = self.book.due(cred.auth, now, after_401=state.status == OUT and refused_401(state.reason))
            if reason is None or (state.status == OUT and reason not in (AFTER_401, REFUSED_AGAIN)):
                continue  # out of rotation for something a refresh does not fix
            if reason == REFUSED_AGAIN:  # its forced refresh's token refused too: no loop against the endpoint
                self._failed(cred, Permanent("HTTP 401"), "upstream answered 401 to its freshly refreshed token too")
                continue
            self.book.start(cred.auth, reason)
            try:
                task = asyncio.get_running_loop().create_task(self.refresh(cred, reason))
            except RuntimeError:
                self.book.transient(cred.auth, now)
                return
            self.tasks[cred.auth.account] = task
            task.add_done_callback(functools.partial(self._forget, cred.auth.account))

    def _forget(self, account: str, _done: asyncio.Task) -> None:
        self.tasks.pop(account, None)

    def _enabled(self) -> bool:
        from mitmproxy import ctx

        try:
            return bool(ctx.options.failover_token_refresh)
        except (AttributeError, KeyError):
            return False

    def _url(self) -> str:
        from mitmproxy import ctx

        return str(ctx.options.failover_refresh_url)

    async def refresh(self, cred: Credential, reason: str) -> None:
        """One refresh of `cred` (started by `check`: its state is REFRESHING)."""
        auth, path = cred.auth, str(cred.auth_file)
        try:
            if not await self._claim(auth.account):
                self.book.elsewhere(auth, time.time())
                log.info("codex-failover: credential %s: another proxy is refreshing this account; its tokens are "
                         "read from the file", cred.name)
                return
            try:
                fd = await asyncio.to_thread(auth_refresh.acquire, path)
                try:
                    await self._locked(cred, reason, path)
                finally:
                    auth_refresh.release(fd)
            finally:
                await self._release(auth.account)
        except NoAnswer as exc:
            wait = self.book.unanswered(auth, time.time())
            log.warning("codex-failover: credential %s: token refresh got no answer (%s); the endpoint may have used "
                        "the refresh token: the next try, in %ds, reads auth.json first", cred.name, exc, wait)
        except (OSError, TimeoutError, ValueError, ConnectFailed, asyncio.IncompleteReadError) as exc:
            wait = self.book.transient(auth, time.time())
            log.warning("codex-failover: credential %s: token refresh failed (%s); next try in %ds", cred.name,
                        _brief(exc), wait)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave the account stuck in REFRESHING
            wait = self.book.transient(auth, time.time())
            log.warning("codex-failover: credential %s: token refresh failed (%s); next try in %ds", cred.name,
                        type(exc).__name__, wait)

    async def _locked(self, cred: Credential, reason: str, path: str) -> None:
        auth = cred.auth
        try:
            doc, snap = await asyncio.to_thread(auth_refresh.read_snapshot, path)
            current = auth_from_document(doc, path)
        except AuthError as exc:
            self.book.transient(auth, time.time())  # the auth watch says what is wrong with the file
            log.info("codex-failover: credential %s: no token refresh: %s", cred.name, exc)
            return
        if current.fingerprint != auth.fingerprint and (reason == AFTER_401 or reason_due(current, time.time()) is None):
            self._adopt(cred, current, path, "refreshed by another program (its auth.json read again)", reason)
            return
        while True:  # bounded: a second pass only after `book.reused` allowed one more try
            tokens = doc.get("tokens") if isinstance(doc.get("tokens"), dict) else {}
            sent = tokens.get("refresh_token") if isinstance(tokens, dict) else None
            if not isinstance(sent, str) or not sent:
                self._failed(cred, Permanent("no refresh_token"), f"{path} holds no refresh_token")
                return
            outcome = await self._ask(cred, sent)
            if isinstance(outcome, Refreshed):
                return await self._write(cred, doc, snap, outcome, path, reason)
            if isinstance(outcome, Permanent):
                return self._failed(cred, outcome)
            if not isinstance(outcome, Reused):
                wait = self.book.transient(auth, time.time())
                log.warning("codex-failover: credential %s: token refresh failed (%s); next try in %ds", cred.name,
                            outcome.why, wait)
                return
            if await self._theirs(cred, path, sent, reason, "refresh_token_reused"):
                return
            again = self.book.reused(auth)  # only after an exchange whose answer never came: once more
            if again is None:
                return self._failed(cred, Permanent("refresh_token_reused"))
            log.warning("codex-failover: credential %s: refresh_token_reused after an exchange that got no answer; "
                        "auth.json unchanged: one more try in %ds", cred.name, again)
            await self.sleep(again)
            if await self._theirs(cred, path, sent, reason, "refresh_token_reused"):
                return
            doc, snap = await asyncio.to_thread(auth_refresh.read_snapshot, path)

    async def _ask(self, cred: Credential, sent: str) -> Outcome:
        """The exchange, through the credential's route; what the answer means (it goes no further)."""
        pool = self.owner.pool
        endpoints = pool.routes.get(cred.route) or (None,)
        shared = self.owner.shared()
        status, answer = await post_json(self._url(), request_doc(sent), endpoints[0], shared.bridges,
                                         shared.upstream_tls, pool.policy.connect_timeout, ANSWER_TIMEOUT)
        return judge(status, answer)

    async def _theirs(self, cred: Credential, path: str, sent: str, reason: str, why: str) -> bool:
        """auth.json read again: someone else's refresh (another refresh token) adopted: True."""
        try:
            again = await asyncio.to_thread(auth_refresh.read_doc, path)
            theirs = again.get("tokens") or {}
            current = auth_from_document(again, path)
        except AuthError:
            return False
        if isinstance(theirs, dict) and theirs.get("refresh_token") not in (None, sent):
            self._adopt(cred, current, path, f"refreshed by another program ({why}; its auth.json read again)", reason)
            return True
        return False

    async def _write(self, cred: Credential, doc: dict, snap: Snapshot, outcome: Refreshed, path: str, reason: str) -> None:
        """The new tokens into the file, unless it changed since it was read (a `codex logout` or a
        new `codex login` meanwhile: that wins, the refreshed tokens are dropped)."""
        written = None
        for _ in range(2):  # once more only over a file rewritten with the same login (same_login)
            new_doc = merge(doc, outcome.tokens, time.time())
            try:
                await asyncio.to_thread(auth_refresh.write_doc, path, new_doc, snap)
                written = new_doc
                break
            except auth_refresh.Changed:
                try:
                    doc, now = await asyncio.to_thread(auth_refresh.read_snapshot, path)
                except AuthError:
                    break
                if not same_login(snap, now):
                    break
                snap = now
        if written is None:
            log.warning("codex-failover: credential %s: %s changed while its token refresh was under way (codex "
                        "login or logout); the refreshed tokens are dropped and the file is read again", cred.name,
                        path)
            # The auth watch reads the file again (before the next request is served) and says what it
            # found (gone: out of rotation; a new login: reloaded, in rotation); a new token starts afresh here.
            self.book.elsewhere(cred.auth, time.time())
            return
        self._adopt(cred, auth_from_document(written, path), path, f"tokens refreshed ({reason})", reason)

    def _adopt(self, cred: Credential, new: AuthMaterial, path: str, how: str, reason: str) -> None:
        """`new` in force from the next attempt on, in the pool as it is now (it may have been
        reloaded meanwhile)."""
        self.book.done(cred.auth, new)
        owner = self.owner
        owner.files.auth.wrote(path)  # not a change for the auth watch to report again
        pool = owner.pool
        if any(c.name == cred.name and c.auth_file == cred.auth_file for c in pool.credentials):
            owner.pool = replace(pool, credentials=tuple(replace(c, auth=new) if c.name == cred.name else c
                                                         for c in pool.credentials))
        if reason == AFTER_401:
            owner.health.restore(cred.name)
            log.warning("codex-failover: credential %s: %s; in rotation again", cred.name, how)
        else:
            log.info("codex-failover: credential %s: %s", cred.name, how)

    def _failed(self, cred: Credential, outcome: Permanent, why: str | None = None) -> None:
        """Out of rotation until a new login, with one line naming the fix."""
        self.book.permanent(cred.auth)
        fix = login_command(cred.auth_file)
        what = why or f"token refresh refused ({outcome.code})"
        self.owner.health.take_out(cred.name, f"{what}; log in again: {fix}")
        log.error("codex-failover: credential %s: %s; out of rotation until you log in again: %s", cred.name, what,
                  fix)

    async def _claim(self, account: str) -> bool:
        store = getattr(self.owner.keeper, "store", None)
        if store is None or not hasattr(store, "claim"):
            return True  # no shared store: the file's lock is the only one needed
        try:
            return bool(await asyncio.to_thread(store.claim, f"refresh:{account}", self.me, CLAIM_TTL))
        except Exception:  # noqa: BLE001 - a store that fails: refresh on this proxy's own (as state does)
            return True

    async def _release(self, account: str) -> None:
        store = getattr(self.owner.keeper, "store", None)
        if store is not None and hasattr(store, "release"):
            try:
                await asyncio.to_thread(store.release, f"refresh:{account}", self.me)
            except Exception:  # noqa: BLE001 - the claim lapses by itself
                pass

    def stop(self) -> None:
        for task in [*self.tasks.values(), *([self.loop] if self.loop else [])]:
            task.cancel()
        self.loop = None


def _brief(exc: BaseException) -> str:
    """A failure in a few words, never what an answer held."""
    if isinstance(exc, ConnectFailed):
        return f"could not reach the token endpoint: {exc.kind}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {os.strerror(exc.errno) if exc.errno else 'connection failed'}"
    return type(exc).__name__
