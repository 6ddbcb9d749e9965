"""Session affinity: a Codex session sticks to the credential that served its last turn, so its
prompt cache stays warm. Bounded in memory and time. Pure, clock injected."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


def session_of(headers, body: object) -> str | None:
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


class Affinity:
    def __init__(self, idle: float = 3600.0, max_sessions: int = 10000, clock: Callable[[], float] = time.monotonic):
        self.idle = idle
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # least recently used first

    def get(self, session: str | None) -> str | None:
        if session is None or self.idle <= 0:  # idle 0: affinity off
            return None
        self._expire()
        entry = self._sessions.get(session)
        return entry[0] if entry else None

    def set(self, session: str | None, key: str) -> None:
        if session is None or self.idle <= 0:
            return
        self._sessions[session] = (key, self._clock())
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def entries(self) -> list[tuple[str, str, float]]:
        """(session, credential key, last seen on this clock), least recently used first."""
        self._expire()
        return [(session, key, seen) for session, (key, seen) in self._sessions.items()]

    def restore(self, session: str, key: str, seen: float) -> None:
        """A session remembered from before a restart (`seen` on this clock), if still live."""
        if self.idle > 0 and seen > self._clock() - self.idle:
            self._sessions[session] = (key, seen)
            self._sessions.move_to_end(session)

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
