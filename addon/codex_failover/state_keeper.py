"""Keeps the pool's in-memory state (health, usage windows, route backoff, session affinity) in a
store, so a restart keeps every cooldown, out-of-rotation mark, usage window, backoff and session
still in force. docs/state.md.

Rows carry non-secret ids: a credential is `cred:<hash>` of its ChatGPT account id or API key
(stable across machines and local names), a client's own credential `client:<hash>` as the health
keys already are, a route endpoint the hash of its whole URL. Times are stored as epoch seconds;
route backoff and affinity run on the monotonic clock in memory and are converted.

What to write is tracked, not searched for: each in-memory store is a `Tracked` and marks the keys
a mutation changed (core/tracked.py). A pass converts only those keys to rows, so it costs the
changes, not the entries held, and the flush loop sleeps on an event the marking sets: while
nothing changes there is no timer and no write (a shared store still reads the others' rows every
REFRESH seconds). Expiry is never a change: rows carry their expiry and the store drops them by it.

Adding a kind of row (e.g. which credential produced a response id) is one small adapter:
1. its in-memory store subclasses `Tracked` and calls `self._changed(key)` on each mutation that
   changes what the key's row says, and offers `keys()` (every key held) and a lookup of one key;
2. a `Kind` in `StateKeeper.__init__`: `rows(key)` (the key's rows now, [] once gone: then its
   ids are deleted) and `ids(key)` (every (kind, id) the key may be stored under);
3. a branch in `_apply_row` that puts a stored row back into memory (expired rows never reach it).
Pure but for `run` (asyncio) and the store's own I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from .core.affinity import Affinity
from .core.auth import CHATGPT, AuthMaterial, jwt_claims
from .config import PoolConfig
from .core.health import COOLING, OUT, Health
from .core.routes import Endpoint, RouteHealth
from .state_store import Row, Store, describe_fault, location, open_store
from .core.tracked import Tracked
from .core.usage import UsageBook, Window

log = logging.getLogger("codex_failover")
FLUSH = 0.2  # seconds from the first change to its write (what one request changes: one write)
REFRESH = 0.5  # a shared store (Redis): how often the others' rows are read (a local cache, <= 1 s old)
RETRY_FIRST = 1.0  # a store that fails is tried again after this, doubling
RETRY_MAX = 30.0  # up to this
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


@dataclass(frozen=True)
class Kind:
    """One in-memory store's entries as rows: the adapter the keeper converts marked keys with."""

    source: Tracked
    rows: Callable[[Hashable], list[Row]]  # the key's rows now ([] once it holds none)
    ids: Callable[[Hashable], list[tuple[str, str]]]  # every (kind, id) the key may be stored under


class StateKeeper:
    def __init__(self, store: Store | None, health: Health, usage: UsageBook, routes: RouteHealth, affinity: Affinity,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        self.store, self.health, self.usage, self.routes, self.affinity = store, health, usage, routes, affinity
        self._wall, self._mono = wall, mono
        self._ids: dict[str, str] = {}  # health key (pool name) -> credential id
        self._keys: dict[str, str] = {}  # credential id -> health key
        self._fingerprints: dict[str, str] = {}  # health key -> its secret's fingerprint (for `out` rows)
        self._endpoints: dict[str, Endpoint] = {}  # endpoint key (route#i) -> endpoint
        self.kinds = [Kind(health, self._health_rows, self._health_ids), Kind(usage, self._usage_rows, self._usage_ids),
                      Kind(routes, self._route_rows, self._route_ids),
                      Kind(affinity, self._session_rows, lambda s: [("session", s)])]
        self.changed = asyncio.Event()  # set by every mark: the flush loop's only wake-up for a local store
        for kind in self.kinds:
            kind.source.on_change = self.changed.set
        self._whole = False  # write every row at the next pass (the store came back, or began afresh)
        self._down_until = 0.0  # on the monotonic clock: the store is not tried before this
        self._retry = 0.0  # the current retry delay while the store fails
        self._refreshed = 0.0  # monotonic time of the last read of a shared store
        self.spec, self.namespace, self.where = "", "", ""  # the store it was opened for (open_keeper)
        self.opener: Callable[[], Store] | None = None  # while `store` is None: opens it (retried)
        self.task: asyncio.Task | None = None  # its flush loop (`run`)
        self.passes = 0  # flush passes run (tests: an idle proxy runs none)

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

    # -- memory -> rows, one key at a time (the adapters of `kinds`) -----------------------

    def _health_rows(self, marked: tuple[str, str]) -> list[Row]:
        status, key = marked
        stored = self.health.stored(status, key)
        if stored is None:
            return []
        until, reason = stored
        if status == OUT:
            return [Row(OUT, self._id(key), {"reason": reason, "fingerprint": self._fingerprint(key)}, None)]
        return [Row(COOLING, self._id(key), {"until": until, "reason": reason}, until)]

    def _health_ids(self, marked: tuple[str, str]) -> list[tuple[str, str]]:
        return [(marked[0], self._id(marked[1]))]

    def _usage_rows(self, key: str) -> list[Row]:
        windows = self.usage.windows(key)
        if not windows:
            return []
        resets = [w.resets_at for w in windows if w.resets_at]
        value = {"windows": [[w.name, w.used_percent, w.resets_at] for w in windows]}
        return [Row("usage", self._id(key), value, max(resets) if resets else self._wall() + USAGE_TTL)]

    def _usage_ids(self, key: str) -> list[tuple[str, str]]:
        return [("usage", self._id(key))]

    def _route_rows(self, key: str) -> list[Row]:
        ep, stored = self._endpoints.get(key), self.routes.stored(key)
        if ep is None or stored is None:
            return []
        failures, until, reason = stored
        at = self._wall() + (until - self._mono())
        return [Row("route", endpoint_id(ep), {"failures": failures, "until": at, "reason": reason}, at + self.routes.cap)]

    def _route_ids(self, key: str) -> list[tuple[str, str]]:
        ep = self._endpoints.get(key)
        return [("route", endpoint_id(ep))] if ep is not None else []

    def _session_rows(self, session: str) -> list[Row]:
        stored = self.affinity.stored(session)
        if stored is None:
            return []
        key, seen = stored
        at = self._wall() + (seen - self._mono())  # converted once, when it moved (Affinity.set)
        return [Row("session", session, {"credential": self._id(key), "seen": at}, at + self.affinity.idle)]

    def snapshot(self) -> dict[tuple[str, str], Row]:
        """Every row still in force (a whole rewrite; tests). O(entries): not for every pass."""
        wall = self._wall()
        return {(r.kind, r.id): r for kind in self.kinds for key in kind.source.keys() for r in kind.rows(key)
                if r.expires is None or r.expires > wall}

    # -- rows -> memory --------------------------------------------------------------------

    def apply(self, rows: list[Row], sessions: bool = True) -> int:
        """Apply stored rows to memory (expired ones were dropped by the store); how many applied.
        Cooldowns are never shortened, a route's later local backoff wins."""
        wall, mono = self._wall(), self._mono()
        by_endpoint = {endpoint_id(ep): ep for ep in self._endpoints.values()}
        if not sessions:
            rows = [r for r in rows if r.kind != "session"]
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
                self.health.cool_until(key, float(value["until"]), value["reason"])  # Health runs on wall time
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

    def applied_quietly(self, rows: list[Row], sessions: bool = True) -> int:
        """`apply` rows the store holds already: what they change is not marked to be written back
        (local marks made before are kept)."""
        saved = [(kind.source, kind.source.take()) for kind in self.kinds]
        try:
            return self.apply(rows, sessions)
        finally:
            for source, keys in saved:
                source.take()
                source.dirty |= keys
            if not any(keys for _, keys in saved):
                self.changed.clear()

    def start(self, rows: list[Row]) -> int:
        """At start: apply what the store holds; it is all written already."""
        return self.applied_quietly(rows)

    # -- what changed ----------------------------------------------------------------------

    def _take(self) -> list[tuple[Kind, set]]:
        if self._whole:
            self._whole = False
            for kind in self.kinds:
                kind.source.dirty.update(kind.source.keys())
        self.changed.clear()  # marks from here on wake the next pass
        return [(kind, kind.source.take()) for kind in self.kinds]

    def _convert(self, taken: list[tuple[Kind, set]]) -> tuple[list[Row], list[tuple[str, str]]]:
        upserts: dict[tuple[str, str], Row] = {}
        deletes: dict[tuple[str, str], None] = {}
        for kind, keys in taken:
            for key in keys:
                for row in kind.rows(key):
                    upserts[(row.kind, row.id)] = row
                for id_ in kind.ids(key):
                    if id_ not in upserts:
                        deletes[id_] = None
        return list(upserts.values()), [k for k in deletes if k not in upserts]

    @staticmethod
    def _give_back(taken: list[tuple[Kind, set]]) -> None:
        """A write that failed: its keys are marked again (written at the next try)."""
        for kind, keys in taken:
            kind.source.dirty |= keys

    def changes(self) -> tuple[list[Row], list[tuple[str, str]]]:
        """What to write since the last call: changed rows, and the ids of rows gone. Costs the
        keys marked since, not the entries held."""
        return self._convert(self._take())

    # -- the loop --------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        return bool(getattr(self.store, "shared", False))

    async def run(self) -> None:
        """Until cancelled: once something is marked, wait FLUSH seconds (what one request changes
        is one write) and write what changed, off the event loop; for a shared store, also read
        the others' rows every REFRESH seconds. With nothing marked and a local store it sleeps on
        `changed` alone: no timer. A failing store (or one not open yet) is logged once and
        retried with backoff; the proxy keeps serving on its own memory meanwhile (fail-open)."""
        while True:
            await self._wait()
            if self.store is None:
                await self._guarded(self._open)
                continue
            self.passes += 1
            await self._guarded(self.flush)
            if self.shared and self._mono() - self._refreshed >= REFRESH:
                await self._guarded(self.refresh)

    async def _wait(self) -> None:
        now = self._mono()
        if now < self._down_until or self.store is None:  # retrying on its own timer
            await asyncio.sleep(max(0.0, self._down_until - now))
            return
        timeout = max(0.0, self._refreshed + REFRESH - now) if self.shared else None
        if not self.changed.is_set():
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                return  # a shared store's refresh is due
        await asyncio.sleep(FLUSH)

    async def flush(self) -> bool:
        """Write what changed; True if anything had."""
        taken = self._take()
        upserts, deletes = self._convert(taken)
        if not (upserts or deletes):
            return False
        try:
            fresh = await asyncio.get_running_loop().run_in_executor(None, self.store.write, upserts, deletes)
        except BaseException:
            self._give_back(taken)
            raise
        if fresh:
            log.warning("codex-failover: pool state file %s was %s while running; writing it afresh", self.where, fresh)
            self._whole = True
            self.changed.set()
        return True

    async def refresh(self) -> None:
        """The others' changes (a shared store): cooldowns, out-of-rotation marks, usage, backoffs."""
        self._refreshed = self._mono()
        rows = await asyncio.get_running_loop().run_in_executor(None, self.store.load, self._wall())
        self.applied_quietly(rows, sessions=False)

    async def _open(self) -> None:
        """A store that could not be opened at start, tried again: what it holds is restored, and
        everything learned meanwhile written to it."""
        loop = asyncio.get_running_loop()
        store = await loop.run_in_executor(None, self.opener)
        try:
            rows = await loop.run_in_executor(None, store.load, self._wall())
        except BaseException:
            store.close()
            raise
        self.store = store
        say_restored(self, self.applied_quietly(rows))
        self._whole = True
        self.changed.set()

    async def _guarded(self, step):
        try:
            result = await step()
        except Exception as exc:  # noqa: BLE001 - state is a convenience: serving never depends on it
            if not self._retry:
                log.warning("codex-failover: pool state store unavailable: %s: %s; serving on this proxy's own "
                            "view, retrying", self.where, describe_fault(exc))
            self._retry = min(RETRY_MAX, self._retry * 2 or RETRY_FIRST)
            self._down_until = self._mono() + self._retry
            self._whole = True  # once it is back, everything is written again
            return
        if self._retry:
            log.warning("codex-failover: pool state store is back; sharing again")
            self._retry = 0.0
        return result

    def detach(self) -> None:
        """Stop tracking (a keeper being replaced or closed)."""
        for kind in self.kinds:
            if kind.source.on_change == self.changed.set:
                kind.source.on_change = None


def say_restored(keeper: StateKeeper, applied: int) -> None:
    """The start-up line: where the state is and how much was restored (a warning if read-only)."""
    entries = f"{applied} entr{'y' if applied == 1 else 'ies'} restored"
    if getattr(keeper.store, "read_only", False):
        log.warning("codex-failover: pool state file %s is read-only: %s from it; changes are kept in memory only",
                    keeper.where, entries)
    else:
        log.info("codex-failover: pool state in %s (namespace %s): %s", keeper.where, keeper.namespace, entries)


def open_keeper(pool: PoolConfig, current: StateKeeper | None, health: Health, usage: UsageBook,
                route_health: RouteHealth, affinity: Affinity) -> StateKeeper:
    """The keeper for `pool`'s state store: the current one if the store is the same, else a new
    one, with what is still in force restored and its flush task running. A store that cannot be
    opened is logged once and tried again with backoff (state in memory meanwhile): the proxy
    always starts."""
    spec = pool.state
    if current is not None and (current.spec, current.namespace) == (spec.store, spec.namespace):
        current.bind(pool)
        return current
    close_keeper(current)
    keeper = StateKeeper(None, health, usage, route_health, affinity)
    keeper.spec, keeper.namespace, keeper.where = spec.store, spec.namespace, location(spec.store)
    keeper.opener = lambda: open_store(spec.store, spec.namespace)
    keeper.bind(pool)
    try:
        store = keeper.opener()
        keeper.store = store
        say_restored(keeper, keeper.start(store.load(time.time())))
    except Exception as exc:  # noqa: BLE001 - sqlite3, OSError or Redis: never keep the proxy from starting
        log.warning("codex-failover: pool state store unavailable: %s: %s; keeping state in memory, retrying",
                    keeper.where, describe_fault(exc))
        if keeper.store is not None:
            keeper.store.close()
            keeper.store = None  # opened and read again by the flush loop (`_open`)
        keeper._retry = RETRY_FIRST
        keeper._down_until = keeper._mono() + keeper._retry
    try:
        keeper.task = asyncio.get_running_loop().create_task(keeper.run())
    except RuntimeError:  # no event loop (a configure outside it): flushed at close
        pass
    return keeper


def close_keeper(keeper: StateKeeper | None) -> None:
    """Write what changed since the last flush, then close (at exit, or when the store changes)."""
    if keeper is None:
        return
    keeper.detach()
    if keeper.task is not None:
        keeper.task.cancel()
        keeper.task = None
    if keeper.store is None:
        return
    try:
        keeper.store.write(*keeper.changes())
    except Exception as exc:  # noqa: BLE001 - never fail a shutdown over state
        log.warning("codex-failover: could not save pool state at exit: %s", describe_fault(exc))
    keeper.store.close()
