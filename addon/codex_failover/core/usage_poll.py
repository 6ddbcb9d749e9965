"""When the dashboard asks each account's usage endpoint (its 5-hour and weekly windows), so every
account shows its headroom, an unused spare's too. Pure: the clock is passed in; the shell
(mitm/usage_poll.py) asks and records the answers in the usage book.

Bounded: only while someone watches the dashboard (it was fetched in the last WATCHED seconds),
each account at most once every EVERY seconds, sooner after a rejection (but never twice within
MIN_GAP), at most PER_ROUND accounts a round, and never an account that rests (cooling, out of
rotation) or whose token expired: its own answers say what it has, and asking would only spend it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

EVERY = 300.0  # seconds between two asks of one account
MIN_GAP = 60.0  # after a rejection: asked again no sooner than this
WATCHED = 600.0  # the dashboard counts as open this long after its last fetch
PER_ROUND = 8
READY = "ready"


@dataclass
class UsagePoll:
    every: float = EVERY
    min_gap: float = MIN_GAP
    watched_for: float = WATCHED
    per_round: int = PER_ROUND
    _asked: dict[str, float] = field(default_factory=dict)  # key -> when last asked
    _watched_at: float | None = None
    _rejected_at: float | None = None  # the last rejection seen

    def watched(self, now: float) -> None:
        """The dashboard was fetched."""
        self._watched_at = now

    def rejection(self, now: float) -> None:
        """An attempt was rejected: the ready accounts' windows are worth asking again soon."""
        self._rejected_at = now

    def due(self, accounts: Iterable[tuple[str, str]], now: float) -> list[str]:
        """The keys to ask now, of `accounts` (key, state): oldest asked first."""
        if self._watched_at is None or now - self._watched_at > self.watched_for:
            return []
        out = []
        for key, state in accounts:
            if state != READY:
                continue
            last = self._asked.get(key)
            if last is None or now - last >= self.every or (
                    self._rejected_at is not None and self._rejected_at > last and now - last >= self.min_gap):
                out.append((last if last is not None else float("-inf"), key))
        return [key for _, key in sorted(out)[:self.per_round]]

    def asked(self, key: str, now: float) -> None:
        self._asked[key] = now

    def forget(self, keep: Iterable[str]) -> None:
        """Accounts no longer in the pool or seen are not remembered (bounded by the pool and the
        clients seen)."""
        kept = set(keep)
        for key in [k for k in self._asked if k not in kept]:
            del self._asked[key]
