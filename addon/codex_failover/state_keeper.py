"""Keeps the pool's in-memory state (health, usage windows, route backoff, session affinity) in a
store, so a restart keeps every cooldown, out-of-rotation mark, usage window, backoff and session
still in force. docs/state.md.

Rows carry non-secret ids: a credential is `cred:<hash>` of its ChatGPT account id or API key
(stable across machines and local names), a client's own credential `client:<hash>` as the health
keys already are, a route endpoint the hash of its whole URL. Times are stored as epoch seconds;
route backoff and affinity run on the monotonic clock in memory and are converted. Change
detection is a diff of snapshots, flushed every FLUSH seconds off the event loop (less often while
nothing changes: `next_interval`, `poke`). Pure but for `run` (asyncio) and the store's own I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import logging
import time
from typing import Callable

from .core.affinity import Affinity
from .core.auth import CHATGPT, AuthMaterial, jwt_claims
from .config import PoolConfig
from .core.health import COOLING, OUT, Health
from .core.routes import Endpoint, RouteHealth
from .state_store import Row, Store, open_store
from .core.usage import UsageBook, Window

log = logging.getLogger("codex_failover")
FLUSH = 0.2  # seconds between writes of what changed
IDLE_FLUSH = 3.2  # a local store where nothing changed: looked at less often (doubling from FLUSH), until a poke
REFRESH = 0.5  # a shared store (Redis): how often the others' rows are read (a local cache, <= 1 s old)
RETRY_MAX = 30.0  # a store that fails is tried again after 1 s, doubling up to this
USAGE_TTL = 7 * 24 * 3600.0  # a usage window with no reset time is kept this long


def _session_order(row: Row) -> float:
    """Sessions oldest first (affinity keeps the least recently used first); others anywhere."""
    seen = row.value.get("seen", 0) if row.kind == "session" and isinstance(row.value, dict) else 0
    return seen if isinstance(seen, (int, float)) else 0


def credential_id(auth: AuthMaterial) -> str:
    """Stable across machines and token refreshes, and not a secret: a ChatGPT login is its account
    and its user (members of one Team workspace share the account id), an API key its own hash."""
    basis = f"key:{auth.token}"
    if auth.kind == CHATGPT and auth.account_id:
        claims = jwt_claims(auth.token)
        profile = claims.get("https://api.openai.com/auth")
        user = (profile.get("chatgpt_user_id") if isinstance(profile, dict) else None) or claims.get("sub")
        if isinstance(user, str) and user:
            basis = f"acct:{auth.account_id}|user:{user}"
    return "cred:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def endpoint_id(ep: Endpoint) -> str:
    """Without the password: an unsalted hash of it would let whoever reads the store test guesses."""
    basis = "|".join(map(str, (ep.scheme, ep.host, ep.port, ep.username)))
    return "ep:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


class StateKeeper:
    def __init__(self, store: Store, health: Health, usage: UsageBook, routes: RouteHealth, affinity: Affinity,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        self.store, self.health, self.usage, self.routes, self.affinity = store, health, usage, routes, affinity
        self._wall, self._mono = wall, mono
        self._ids: dict[str, str] = {}  # health key (pool name) -> credential id
        self._keys: dict[str, str] = {}  # credential id -> health key
        self._fingerprints: dict[str, str] = {}  # health key -> its secret's fingerprint (for `out` rows)
        self._endpoints: dict[str, Endpoint] = {}  # endpoint key (route#i) -> endpoint
        self._written: dict[tuple[str, str], Row] = {}
        self._down_until = 0.0  # on the monotonic clock: the store is not tried before this
        self._retry = 0.0  # the current retry delay while the store fails
        self._refreshed = 0.0  # monotonic time of the last read of a shared store
        self.spec, self.namespace = "", ""  # the store it was opened for (open_keeper)
        self.task: asyncio.Task | None = None  # its flush loop (`run`)
        self.interval = FLUSH  # until the next look for changes
        self._poked: asyncio.Event | None = None  # set by `poke` while the loop waits

    # -- mapping ---------------------------------------------------------------------------

    def bind(self, pool: PoolConfig) -> None:
        """The current pool: which local names and endpoints the stored ids stand for."""
        self._ids = {c.name: credential_id(c.auth) for c in pool.credentials}
        self._keys = {v: k for k, v in self._ids.items()}
        self._fingerprints = {c.name: c.auth.fingerprint for c in pool.credentials}
        self._endpoints = {ep.key: ep for eps in pool.routes.values() for ep in eps or ()}

    def _id(self, key: str) -> str:
        return self._ids.get(key, key)  # client keys (`client:<hash>`) are ids already

    def _key(self, id_: str) -> str | None:
        if id_.startswith("client:"):
            return id_
        return self._keys.get(id_)

    def _fingerprint(self, key: str) -> str:
        return self._fingerprints.get(key) or key.removeprefix("client:")

    # -- rows <-> memory -------------------------------------------------------------------

    def snapshot(self) -> dict[tuple[str, str], Row]:
        rows: list[Row] = []
        for key, status, until, reason in self.health.entries():
            if status == COOLING:
                rows.append(Row(COOLING, self._id(key), {"until": until, "reason": reason}, until))
            elif status == OUT:
                rows.append(Row(OUT, self._id(key), {"reason": reason, "fingerprint": self._fingerprint(key)}, None))
        wall, mono = self._wall(), self._mono()
        for key, windows in self.usage.entries().items():
            resets = [w.resets_at for w in windows if w.resets_at]
            value = {"windows": [[w.name, w.used_percent, w.resets_at] for w in windows]}
            rows.append(Row("usage", self._id(key), value, max(resets) if resets else wall + USAGE_TTL))
        for ep_key, failures, until, reason in self.routes.entries():
            ep = self._endpoints.get(ep_key)
            if ep is not None:
                at = wall + (until - mono)
                rows.append(Row("route", endpoint_id(ep), {"failures": failures, "until": at, "reason": reason},
                                at + self.routes.cap))
        for session, key, seen in self.affinity.entries():
            at = wall + (seen - mono)
            rows.append(Row("session", session, {"credential": self._id(key), "seen": at}, at + self.affinity.idle))
        return {(r.kind, r.id): r for r in rows}

    def apply(self, rows: list[Row], sessions: bool = True) -> int:
        """Apply stored rows to memory (expired ones were dropped by the store); how many applied.
        Cooldowns are never shortened, a route's later local backoff wins."""
        wall, mono = self._wall(), self._mono()
        by_endpoint = {endpoint_id(ep): ep for ep in self._endpoints.values()}
        applied = 0
        for row in sorted(rows, key=_session_order):
            try:
                applied += self._apply_row(row, wall, mono, by_endpoint, sessions)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # a row of another shape (another version shares the store): skipped alone
        return applied

    def _apply_row(self, row: Row, wall: float, mono: float, by_endpoint: dict, sessions: bool) -> int:
        """1 if the row was applied, 0 if it does not concern this pool (or is stale)."""
        value = row.value
        if row.kind in (COOLING, OUT, "usage"):
            key = self._key(row.id)
            if key is None:
                return 0
            if row.kind == COOLING:
                if value["until"] <= wall:
                    return 0
                self.health.cool(key, value["until"] - wall, value["reason"])
            elif row.kind == OUT:
                if value.get("fingerprint") != self._fingerprint(key):
                    return 0  # its key or auth file changed since: back in rotation
                self.health.take_out(key, value["reason"])
            else:
                self.usage.record(key, [Window(n, float(u), r) for n, u, r in value["windows"]])
            return 1
        if row.kind == "route" and (ep := by_endpoint.get(row.id)) is not None:
            until = mono + (value["until"] - wall)
            if self.routes.backing_off_until(ep) >= until:
                return 0  # this proxy knows a later backoff for it
            self.routes.restore(ep, int(value["failures"]), until, str(value["reason"]))
            return 1
        if row.kind == "session" and sessions and (key := self._key(value["credential"])) is not None:
            self.affinity.restore(row.id, key, mono + (value["seen"] - wall))
            return 1
        return 0

    def start(self, rows: list[Row]) -> int:
        """At start: apply what the store holds; it is all written already."""
        applied = self.apply(rows)
        self._written = self.snapshot()
        return applied

    def changes(self) -> tuple[list[Row], list[tuple[str, str]]]:
        """What to write since the last call: changed rows, and the ids of rows gone."""
        current = self.snapshot()
        upserts = [row for k, row in current.items() if self._written.get(k) != row]
        deletes = [k for k in self._written if k not in current]
        self._written = current
        return upserts, deletes

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: write what changed every FLUSH seconds and, for a shared store, read the
        others' rows every REFRESH seconds. A local store where nothing changed is looked at less
        often, up to every IDLE_FLUSH seconds, until the next `poke` (a proxy left on all day wakes
        ~0.3 times a second, not 5). A failing store is logged once and retried with backoff; the
        proxy keeps serving on its own memory meanwhile (fail-open)."""
        shared = getattr(self.store, "shared", False)
        while True:
            await self._wait()
            if self._mono() < self._down_until:
                continue
            wrote = await self._guarded(self.flush)
            if shared and self._mono() - self._refreshed >= REFRESH:
                await self._guarded(self.refresh)
            self.interval = next_interval(self.interval, wrote is not False, shared)  # None: failed, still to write

    def poke(self) -> None:
        """Something that may change the pool began (a request, a WebSocket) or ended (a request):
        look for changes at the FLUSH pace again. A WebSocket's later turns are written within
        IDLE_FLUSH seconds."""
        self.interval = FLUSH
        if self._poked is not None:
            self._poked.set()

    async def _wait(self) -> None:
        """`interval` seconds; after a poke, FLUSH seconds from the poke (what it started may change
        the pool meanwhile: one write for all of it)."""
        self._poked = asyncio.Event()
        try:
            await asyncio.wait_for(self._poked.wait(), self.interval)
        except TimeoutError:
            return
        finally:
            self._poked = None
        await asyncio.sleep(FLUSH)

    async def flush(self) -> bool:
        """Write what changed; True if anything had."""
        upserts, deletes = self.changes()
        if upserts or deletes:
            await asyncio.get_running_loop().run_in_executor(None, self.store.write, upserts, deletes)
        return bool(upserts or deletes)

    async def refresh(self) -> None:
        """The others' changes (a shared store): cooldowns, out-of-rotation marks, usage, backoffs."""
        self._refreshed = self._mono()
        rows = await asyncio.get_running_loop().run_in_executor(None, self.store.load, self._wall())
        self.apply(rows, sessions=False)

    async def _guarded(self, step):
        try:
            result = await step()
        except Exception as exc:  # noqa: BLE001 - state is a convenience: serving never depends on it
            if not self._retry:
                log.warning("codex-failover: pool state store unavailable (%s: %s); serving on this proxy's own "
                            "view, retrying", type(exc).__name__, exc)
            self._retry = min(RETRY_MAX, self._retry * 2 or 1.0)
            self._down_until = self._mono() + self._retry
            self._written = {}  # once it is back, everything is written again
            return
        if self._retry:
            log.warning("codex-failover: pool state store is back; sharing again")
            self._retry = 0.0
        return result


def next_interval(current: float, wrote: bool, shared: bool) -> float:
    """How long the flush loop waits next: FLUSH while there are changes, and always for a shared
    store (the others read them: docs/state.md); doubling up to IDLE_FLUSH while there are none."""
    if wrote or shared:
        return FLUSH
    return min(current * 2, IDLE_FLUSH)


def open_keeper(pool: PoolConfig, current: StateKeeper | None, health: Health, usage: UsageBook,
                route_health: RouteHealth, affinity: Affinity) -> StateKeeper | None:
    """The keeper for `pool`'s state store: the current one if the store is the same, else a new
    one, with what is still in force restored and its flush task running. None (state in memory
    only) when the store cannot be opened: the proxy always starts."""
    spec = pool.state
    if current is not None and (current.spec, current.namespace) == (spec.store, spec.namespace):
        current.bind(pool)
        return current
    close_keeper(current)
    try:
        store = open_store(spec.store, spec.namespace)
    except (OSError, ValueError, ImportError, sqlite3.Error) as exc:
        log.warning("codex-failover: pool state store unavailable (%s); keeping state in memory only",
                    type(exc).__name__)
        return None
    keeper = StateKeeper(store, health, usage, route_health, affinity)
    keeper.spec, keeper.namespace = spec.store, spec.namespace
    keeper.bind(pool)
    try:
        applied = keeper.start(store.load(time.time()))
    except Exception as exc:  # noqa: BLE001 - sqlite3 or Redis: never keep the proxy from starting
        log.warning("codex-failover: could not read pool state from %s (%s); starting clean, retrying",
                    getattr(store, "path", spec.store), type(exc).__name__)
        applied = 0
    where = getattr(store, "path", spec.store)
    log.info("codex-failover: pool state in %s (namespace %s): %d entr%s restored", where, spec.namespace,
             applied, "y" if applied == 1 else "ies")
    try:
        keeper.task = asyncio.get_running_loop().create_task(keeper.run())
    except RuntimeError:  # no event loop (a configure outside it): flushed at close
        pass
    return keeper


def close_keeper(keeper: StateKeeper | None) -> None:
    """Write what changed since the last flush, then close (at exit, or when the store changes)."""
    if keeper is None:
        return
    if keeper.task is not None:
        keeper.task.cancel()
        keeper.task = None
    try:
        keeper.store.write(*keeper.changes())
    except Exception as exc:  # noqa: BLE001 - never fail a shutdown over state
        log.warning("codex-failover: could not save pool state at exit (%s)", exc)
    keeper.store.close()
