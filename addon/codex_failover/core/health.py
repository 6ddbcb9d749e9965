"""Credential health: ready, cooling until a time, or out of rotation. Pure, clock injected."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .cooldown_policy import OverloadStreaks

READY = "ready"
COOLING = "cooling"
OUT = "out"


@dataclass(frozen=True)
class State:
    status: str
    until: float | None = None  # clock time when a cooling credential is ready again
    reason: str | None = None


class Health:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._cooling: dict[str, tuple[float, str]] = {}
        self._out: dict[str, str] = {}
        self.streaks = OverloadStreaks()  # each credential's overload streak (cooldown_policy.py)

    def now(self) -> float:
        return self._clock()

    def cool(self, key: str, seconds: float, reason: str) -> None:
        """Cool for `seconds`; an existing, later cooldown is never shortened."""
        if seconds <= 0:
            return
        until = self._clock() + seconds
        current = self._cooling.get(key)
        if current is None or current[0] < until:
            self._cooling[key] = (until, reason)

    def take_out(self, key: str, reason: str) -> None:
        self._out[key] = reason

    def restore(self, key: str) -> None:
        self._out.pop(key, None)
        self._cooling.pop(key, None)

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
