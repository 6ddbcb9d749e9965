"""Keeps the pool's in-memory state (health, usage windows, route backoff, session affinity) in a
store, so a restart keeps every cooldown, out-of-rotation mark, usage window, backoff and session
still in force. docs/state.md.

The rows and which of them changed are state_rows.py's (adding a kind of row: its docstring). The
flush loop here sleeps on the event the marking sets: while nothing changes there is no timer and
no write; once something is marked, FLUSH seconds later what changed is written in one transaction
off the event loop (a shared store also reads the others' rows every REFRESH seconds). A store that
fails, or could not be opened, is logged once and retried with backoff; the proxy serves on its
memory meanwhile. Pure but for `run` (asyncio) and the store's own I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from .config import PoolConfig
from .core.affinity import Affinity
from .core.health import Health
from .core.provenance import Provenance
from .core.routes import RouteHealth
from .core.usage import UsageBook
from .state_rows import StateRows, credential_id, endpoint_id  # noqa: F401 - credential_id, endpoint_id: re-exported
from .state_store import Store, describe_fault, location, open_store

log = logging.getLogger("codex_failover")
FLUSH = 0.2  # seconds from the first change to its write (what one request changes: one write)
REFRESH = 0.5  # a shared store (Redis): how often the others' rows are read (a local cache, <= 1 s old)
PASS_KEYS = 2000  # marked keys converted in one pass at most (about 5 ms on the event loop)
RETRY_FIRST = 1.0  # a store that fails is tried again after this, doubling
RETRY_MAX = 30.0  # up to this


class StateKeeper(StateRows):
    """Writes what changed to a store off the event loop, reads a shared store's other rows, and
    rides out the store's faults (docs/state.md#when-the-store-fails)."""

    def __init__(self, store: Store | None, health: Health, usage: UsageBook, routes: RouteHealth, affinity: Affinity,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
                 provenance: Provenance | None = None):
        super().__init__(health, usage, routes, affinity, wall, mono, provenance)
        self.store = store
        self._down_until = 0.0  # on the monotonic clock: the store is not tried before this
        self._retry = 0.0  # the current retry delay while the store fails
        self._refreshed = 0.0  # monotonic time of the last read of a shared store
        self.spec, self.namespace, self.where = "", "", ""  # the store it was opened for (open_keeper)
        self.opener: Callable[[], Store] | None = None  # while `store` is None: opens it (retried)
        self.task: asyncio.Task | None = None  # its flush loop (`run`)
        self.passes = 0  # flush passes run (tests: an idle proxy runs none)

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
        store = self.store
        assert store is not None  # (`run` flushes an open store only)
        taken = self._take(PASS_KEYS)
        upserts, deletes = self._convert(taken)
        if not (upserts or deletes):
            return False
        try:
            fresh = await asyncio.get_running_loop().run_in_executor(None, store.write, upserts, deletes)
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
        store = self.store
        assert store is not None  # (`run` refreshes an open store only)
        rows = await asyncio.get_running_loop().run_in_executor(None, store.load, self._wall())
        self.applied_quietly(rows, sessions=False)

    async def _open(self) -> None:
        """A store that could not be opened at start, tried again: what it holds is restored, and
        everything learned meanwhile written to it."""
        loop = asyncio.get_running_loop()
        assert self.opener is not None  # (open_keeper gives a keeper whose store is not open its opener)
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
                route_health: RouteHealth, affinity: Affinity, provenance: Provenance | None = None) -> StateKeeper:
    """The keeper for `pool`'s state store: the current one if the store is the same, else a new
    one, with what is still in force restored and its flush task running. A store that cannot be
    opened is logged once and tried again with backoff (state in memory meanwhile): the proxy
    always starts."""
    spec = pool.state
    if current is not None and (current.spec, current.namespace) == (spec.store, spec.namespace):
        current.bind(pool)
        return current
    close_keeper(current)
    keeper = StateKeeper(None, health, usage, route_health, affinity, provenance=provenance)
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
