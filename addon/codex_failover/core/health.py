"""Credential health: ready, cooling until a time, or out of rotation. Pure, clock injected.
Mutations are tracked (`Tracked`, keys (COOLING or OUT, credential key)) for the state keeper;
a cooldown's end is not a change."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .cooldown_policy import OverloadStreaks, ProbeClaims
from .entitlement import ModelBook
from .tracked import Tracked

READY = "ready"
COOLING = "cooling"
OUT = "out"


@dataclass(frozen=True)
class State:
    status: str
    until: float | None = None  # clock time when a cooling credential is ready again
    reason: str | None = None


class Health(Tracked):
    def __init__(self, clock: Callable[[], float] = time.time):
        super().__init__()
        self._clock = clock
        self._cooling: dict[str, tuple[float, str]] = {}
        self._out: dict[str, str] = {}
        self.streaks = OverloadStreaks()  # each credential's overload streak (cooldown_policy.py)
        self.probes = ProbeClaims()  # the credentials being probed through their overload rest now
        self.models = ModelBook(clock=clock)  # which credential lacks which model (entitlement.py)

    def now(self) -> float:
        return self._clock()

    def cool(self, key: str, seconds: float, reason: str) -> None:
        """Cool for `seconds`; an existing, later cooldown is never shortened."""
        if seconds <= 0:
            return
        self.cool_until(key, self._clock() + seconds, reason)

    def cool_until(self, key: str, until: float, reason: str) -> None:
        """Cool until a clock time (a stored cooldown: the same `until`, not one recomputed from a
        fresh clock read, so a shared store's row read back is not a change)."""
        current = self._cooling.get(key)
        if current is None or current[0] < until:
            self._cooling[key] = (until, reason)
            self._changed((COOLING, key))

    def take_out(self, key: str, reason: str) -> None:
        if self._out.get(key) != reason:
            self._out[key] = reason
            self._changed((OUT, key))

    def restore(self, key: str) -> None:
        if self._out.pop(key, None) is not None:
            self._changed((OUT, key))
        if self._cooling.pop(key, None) is not None:
            self._changed((COOLING, key))

    def stored(self, status: str, key: str) -> tuple[float | None, str] | None:
        """(until, reason) of `key` in that status (OUT: until None), or None (for the state keeper)."""
        if status == OUT:
            reason = self._out.get(key)
            return (None, reason) if reason is not None else None
        cooling = self._cooling.get(key)
        return cooling if cooling is not None and cooling[0] > self._clock() else None

    def keys(self) -> list[tuple[str, str]]:
        """(status, key) of every credential cooling or out of rotation (a whole rewrite of the state)."""
        return [(OUT, key) for key in self._out] + [(COOLING, key) for key in self._cooling]

    def state(self, key: str) -> State:
        if key in self._out:
            return State(OUT, None, self._out[key])
        cooling = self._cooling.get(key)
        if cooling is not None:
            if cooling[0] > self._clock():
                return State(COOLING, cooling[0], cooling[1])
            del self._cooling[key]
        return State(READY)

    def ready(self, key: str) -> bool:
        return self.state(key).status == READY

    def entries(self) -> list[tuple[str, str, float | None, str]]:
        """(key, status, until, reason) of every credential not ready (for the state store)."""
        now = self._clock()
        out = [(key, OUT, None, reason) for key, reason in self._out.items()]
        return out + [(key, COOLING, until, reason) for key, (until, reason) in self._cooling.items() if until > now]

    def recovers_in(self, key: str) -> float | None:
        """Seconds until `key` is ready (0 when ready now), None when it is out of rotation."""
        state = self.state(key)
        if state.status == OUT:
            return None
        return max(0.0, state.until - self._clock()) if state.until is not None else 0.0
