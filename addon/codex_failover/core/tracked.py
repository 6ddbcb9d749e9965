"""What changed in an in-memory store since the state keeper last looked. Pure.

The stores whose entries outlive a restart (credential health, usage windows, route backoff,
session affinity) name each entry they change, so the keeper's pass costs the changes, not the
entries held: 10,000 remembered sessions and one new one is one row converted and written.
A store marks only what changes a stored row; expiry is not a change (the stored row carries its
own expiry, and the store drops it by that).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Sequence


class Tracked:
    """Base of a store the state keeper persists: `_changed(key)` on every mutation that changes
    what the key's row would say; `take()` hands the keeper the keys changed since it last took.
    `on_change` (the keeper's wake-up) is called on each mark, so the keeper sleeps while nothing
    changes instead of looking on a timer."""

    def __init__(self) -> None:
        self.dirty: set[Hashable] = set()
        self.on_change: Callable[[], None] | None = None

    def _changed(self, key: Hashable) -> None:
        self.dirty.add(key)
        if self.on_change is not None:
            self.on_change()

    def take(self) -> set[Hashable]:
        taken, self.dirty = self.dirty, set()
        return taken

    def keys(self) -> Sequence[Hashable]:
        """Every key that holds an entry now (for a whole rewrite)."""
        raise NotImplementedError


class SeenBook(Tracked):
    """key -> (credential key, last used, last use as stored) on an injected clock, least recently
    used first: what session affinity and provenance both remember. Bounded by `limit` (the least
    recently used goes, and its row with it: marked) and forgotten `idle` seconds after its last use
    (not marked: the stored row expires by itself). A new key, a new credential, an eviction and a
    use `step` past the stored one are changes (so a busy key is written once a step, not on every
    use)."""

    def __init__(self, idle: float, limit: int, clock: Callable[[], float], step: Callable[[float], float]):
        super().__init__()
        self.idle, self.limit = idle, limit
        self._clock, self._step = clock, step
        self._entries: OrderedDict[str, tuple[str, float, float]] = OrderedDict()

    def _lookup(self, key: str) -> tuple[str, float, float] | None:
        self._expire()
        return self._entries.get(key)

    def _use(self, key: str, credential: str) -> bool:
        """`key` used now, for `credential`; True if that is new (a new key or another credential)."""
        now, old = self._clock(), self._entries.get(key)
        new = old is None or old[0] != credential
        if new or old is None or now - old[2] >= self._step(self.idle):
            stored = now
            self._changed(key)
        else:
            stored = old[2]
        self._entries[key] = (credential, now, stored)
        self._entries.move_to_end(key)
        self._trim()
        return new

    def stored(self, key: str) -> tuple[str, float] | None:
        """(credential key, the last use to store, on this clock) of a key held (for the state keeper)."""
        entry = self._entries.get(key)
        return (entry[0], entry[2]) if entry is not None else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def restore(self, key: str, credential: str, seen: float) -> None:
        """A key remembered from before a restart, or another proxy's (`seen` on this clock), if still
        live and not known here already (what this proxy saw itself is newer)."""
        if self.idle > 0 and seen > self._clock() - self.idle and key not in self._entries:
            self._entries[key] = (credential, seen, seen)
            self._entries.move_to_end(key)
            self._trim()

    def _trim(self) -> None:
        while len(self._entries) > self.limit:
            gone, _ = self._entries.popitem(last=False)
            self._changed(gone)

    def _expire(self) -> None:
        """Drop idle keys; oldest first, so this stops at the first live one."""
        horizon = self._clock() - self.idle
        while self._entries and next(iter(self._entries.values()))[1] <= horizon:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
