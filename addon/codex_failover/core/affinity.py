"""Session affinity: a Codex session sticks to the credential that served its last turn, so its
prompt cache stays warm. Bounded in memory and time. Pure, clock injected."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Mapping

from .tracked import Tracked


def session_of(headers: Mapping[str, str], body: object) -> str | None:
    """Codex's thread id: the `session-id` header (older: `session_id`), else `prompt_cache_key`."""
    for name in ("session-id", "session_id"):
        value = headers.get(name)
        if value:
            return value
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    return key if isinstance(key, str) and key else None


def affinity_key(client_fingerprint: str | None, session: str | None) -> str | None:
    """What a session's stickiness is filed under: the client credential's fingerprint and the session
    id together, so a request on another key that names the same session never inherits it. None
    (no affinity) without either."""
    if not client_fingerprint or not session:
        return None
    return f"{client_fingerprint}/{session}"


SEEN_STEP = 60.0  # seconds: a session's stored `seen` moves only by this much (or session_idle / 10)


def seen_step(idle: float) -> float:
    """How far a session's last use may run ahead of its stored `seen` before the row is written
    again: 60 s, or a tenth of `session_idle` when that is shorter. A restored session may so be
    forgotten up to this much early; in exchange a busy session is written once a minute, not
    on every turn."""
    return min(SEEN_STEP, idle / 10)


class Affinity(Tracked):
    """Session -> (credential key, last seen, stored seen) on the monotonic clock, least recently
    used first. A new session, a new home, an eviction, and a last use `seen_step` past the stored
    one are tracked (`Tracked`) for the state keeper; an idle session's expiry is not (its row
    expires by itself)."""

    def __init__(self, idle: float = 3600.0, max_sessions: int = 10000, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.idle = idle
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float, float]] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        if session is None or self.idle <= 0:  # idle 0: affinity off
            return None
        self._expire()
        entry = self._sessions.get(session)
        return entry[0] if entry else None

    def set(self, session: str | None, key: str) -> None:
        if session is None or self.idle <= 0:
            return
        now = self._clock()
        old = self._sessions.get(session)
        if old is None or old[0] != key or now - old[2] >= seen_step(self.idle):
            stored = now
            self._changed(session)
        else:
            stored = old[2]
        self._sessions[session] = (key, now, stored)
        self._sessions.move_to_end(session)
        self._trim()

    def entries(self) -> list[tuple[str, str, float]]:
        """(session, credential key, last seen on this clock), least recently used first."""
        self._expire()
        return [(session, key, seen) for session, (key, seen, _) in self._sessions.items()]

    def stored(self, session: str) -> tuple[str, float] | None:
        """(credential key, the `seen` to store, on this clock) of a session held (for the state keeper)."""
        entry = self._sessions.get(session)
        return (entry[0], entry[2]) if entry is not None else None

    def keys(self) -> list[str]:
        return list(self._sessions)

    def restore(self, session: str, key: str, seen: float) -> None:
        """A session remembered from before a restart (`seen` on this clock), if still live."""
        if self.idle > 0 and seen > self._clock() - self.idle:
            self._sessions[session] = (key, seen, seen)
            self._sessions.move_to_end(session)
            self._trim()

    def _trim(self) -> None:
        """Bounded: the least recently used session goes (its row too: marked)."""
        while len(self._sessions) > self.max_sessions:
            session, _ = self._sessions.popitem(last=False)
            self._changed(session)

    def _expire(self) -> None:
        """Drop idle sessions; oldest first, so this stops at the first live one."""
        horizon = self._clock() - self.idle
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest[1] > horizon:
                return
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)
