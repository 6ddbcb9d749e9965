"""What changed in an in-memory store since the state keeper last looked. Pure.

The stores whose entries outlive a restart (credential health, usage windows, route backoff,
session affinity) name each entry they change, so the keeper's pass costs the changes, not the
entries held: 10,000 remembered sessions and one new one is one row converted and written.
A store marks only what changes a stored row; expiry is not a change (the stored row carries its
own expiry, and the store drops it by that).
"""

from __future__ import annotations

from typing import Callable, Hashable


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
