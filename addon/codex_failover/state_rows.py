"""The pool's in-memory state as store rows and back, and which rows changed (for state_keeper.py).

Rows carry non-secret ids: a credential is `cred:<hash>` of its ChatGPT account id or API key
(stable across machines and local names), a client's own credential `client:<hash>` as the health
keys already are, a route endpoint the hash of its whole URL. Times are stored as epoch seconds;
route backoff and affinity run on the monotonic clock in memory and are converted.

What to write is tracked, not searched for: each in-memory store is a `Tracked` and marks the keys
a mutation changed (core/tracked.py); `changes()` converts only those keys, so it costs the changes,
not the entries held. Expiry is never a change: rows carry their expiry and the store drops them by
it.

Adding a kind of row (e.g. which credential produced a response id) is one small adapter:
1. its in-memory store subclasses `Tracked` and calls `self._changed(key)` on each mutation that
   changes what the key's row says, and offers `keys()` (every key held) and a lookup of one key;
2. a `Kind` in `StateRows.__init__`: `rows(key)` (the key's rows now, [] once gone: then its ids
   are deleted) and `ids(key)` (every (kind, id) the key may be stored under);
3. a branch in `_apply_row` that puts a stored row back into memory (expired rows never reach it).
Pure: clocks injected, no I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, TypeVar

from .config import PoolConfig
from .core.affinity import Affinity
from .core.auth import CHATGPT, AuthMaterial, jwt_claims
from .core.health import COOLING, OUT, Health
from .core.provenance import Provenance
from .core.routes import Endpoint, RouteHealth
from .core.tracked import Tracked
from .core.units import sane_epoch, sane_until
from .core.usage import UsageBook, Window, percent
from .state_store import Row

USAGE_TTL = 7 * 24 * 3600.0  # a usage window with no reset time is kept this long
ARTIFACT = "artifact"  # which credential made a response id, a compaction item, encrypted reasoning


def _session_order(row: Row) -> float:
    """Sessions and artifacts oldest first (both keep the least recently used first); others anywhere."""
    seen = row.value.get("seen", 0) if row.kind in ("session", ARTIFACT) and isinstance(row.value, dict) else 0
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


K = TypeVar("K", bound=Hashable)  # a store's key: a credential's, an endpoint's, a session's...


@dataclass(frozen=True)
class Kind(Generic[K]):
    """One in-memory store's entries as rows: the adapter the keeper converts marked keys with."""

    source: Tracked  # (its keys are K's)
    rows: Callable[[K], list[Row]]  # the key's rows now ([] once it holds none)
    ids: Callable[[K], list[tuple[str, str]]]  # every (kind, id) the key may be stored under


class StateRows:
    """The in-memory stores, the ids their rows are stored under, and what changed since the last
    `changes()`. `changed` is set by every mark: the flush loop's wake-up."""

    def __init__(self, health: Health, usage: UsageBook, routes: RouteHealth, affinity: Affinity,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
                 provenance: Provenance | None = None):
        self.health, self.usage, self.routes, self.affinity = health, usage, routes, affinity
        self.provenance = provenance if provenance is not None else Provenance(clock=mono)
        self._wall, self._mono = wall, mono
        self._ids: dict[str, str] = {}  # health key (pool name) -> credential id
        self._keys: dict[str, str] = {}  # credential id -> health key
        self._fingerprints: dict[str, str] = {}  # health key -> its secret's fingerprint (for `out` rows)
        self._endpoints: dict[str, Endpoint] = {}  # endpoint key (route#i) -> endpoint
        self.kinds: list[Kind[Any]] = [Kind(health, self._health_rows, self._health_ids), Kind(usage, self._usage_rows, self._usage_ids),
                      Kind(routes, self._route_rows, self._route_ids),
                      Kind(affinity, self._session_rows, lambda s: [("session", s)]),
                      Kind(self.provenance, self._artifact_rows, lambda a: [(ARTIFACT, a)])]
        self.changed = asyncio.Event()  # set by every mark: the flush loop's only wake-up for a local store
        for kind in self.kinds:
            kind.source.on_change = self.changed.set
        self._whole = False  # every row at the next `changes()` (the store came back, or began afresh)

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

    def _artifact_rows(self, artifact: str) -> list[Row]:
        """Which credential made a response id or encrypted item (ids and digests only: no content)."""
        stored = self.provenance.stored(artifact)
        if stored is None:
            return []
        key, seen = stored
        at = self._wall() + (seen - self._mono())
        return [Row(ARTIFACT, artifact, {"credential": self._id(key), "seen": at}, at + self.provenance.idle)]

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
                until = sane_until(value["until"], wall)  # `Infinity` from another version: a month at most
                if until is None or until <= wall:
                    return 0
                self.health.cool_until(key, until, str(value["reason"]))  # Health runs on wall time
            elif row.kind == OUT:
                if value.get("fingerprint") != self._fingerprint(key):
                    return 0  # its key or auth file changed since: back in rotation
                self.health.take_out(key, value["reason"])
            else:
                self.usage.record(key, [Window(str(n), p, sane_epoch(r)) for n, u, r in value["windows"]
                                        if (p := percent(u)) is not None])
            return 1
        if row.kind == "route" and (ep := by_endpoint.get(row.id)) is not None:
            until = sane_until(value["until"], wall)
            if until is None:
                return 0
            until = mono + (until - wall)
            if self.routes.backing_off_until(ep) >= until:
                return 0  # this proxy knows a later backoff for it
            self.routes.restore(ep, int(value["failures"]), until, str(value["reason"]))
            return 1
        if row.kind == "session" and sessions and (key := self._key(value["credential"])) is not None:
            seen = sane_until(value["seen"], wall, 0.0)
            if seen is None:
                return 0
            self.affinity.restore(row.id, key, mono + (seen - wall))
            return 1
        if row.kind == ARTIFACT and (key := self._key(value["credential"])) is not None:
            seen = sane_until(value["seen"], wall, 0.0)
            if seen is None:
                return 0
            self.provenance.restore(row.id, key, mono + (seen - wall))
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

    def _take(self, limit: int | None = None) -> list[tuple[Kind, set]]:
        """The keys marked since the last take, at most `limit` of them (the rest stay marked, and
        `changed` stays set for them: a whole rewrite of 10,000 sessions is several short passes,
        not one long one on the event loop)."""
        if self._whole:
            self._whole = False
            for kind in self.kinds:
                kind.source.dirty.update(kind.source.keys())
        self.changed.clear()  # marks from here on wake the next pass
        taken, left = [], limit
        for kind in self.kinds:
            source = kind.source
            if left is None or len(source.dirty) <= left:
                keys = source.take()
            else:
                keys = set(itertools.islice(source.dirty, left))
                source.dirty -= keys
                self.changed.set()
            taken.append((kind, keys))
            left = None if left is None else left - len(keys)
        return taken

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

    def changes(self, limit: int | None = None) -> tuple[list[Row], list[tuple[str, str]]]:
        """What to write since the last call: changed rows, and the ids of rows gone (of at most
        `limit` marked keys). Costs the keys marked since, not the entries held."""
        return self._convert(self._take(limit))
