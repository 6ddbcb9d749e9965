"""Session affinity: a Codex session sticks to the credential that served its last turn, so its
prompt cache stays warm. Bounded in memory and time. Pure, clock injected."""

from __future__ import annotations

import time
from typing import Callable, Mapping

from .tracked import SeenBook


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


class Affinity(SeenBook):
    """Session -> the credential key that served its last turn, least recently used first
    (tracked.SeenBook: bounded by `max_sessions`, forgotten `idle` seconds after its last turn)."""

    def __init__(self, idle: float = 3600.0, max_sessions: int = 10000, clock: Callable[[], float] = time.monotonic):
        super().__init__(idle, max_sessions, clock, seen_step)

    @property
    def max_sessions(self) -> int:
        return self.limit

    @max_sessions.setter
    def max_sessions(self, value: int) -> None:
        self.limit = value

    def get(self, session: str | None) -> str | None:
        if session is None or self.idle <= 0:  # idle 0: affinity off
            return None
        entry = self._lookup(session)
        return entry[0] if entry else None

    def set(self, session: str | None, key: str) -> None:
        if session is not None and self.idle > 0:
            self._use(session, key)

    def entries(self) -> list[tuple[str, str, float]]:
        """(session, credential key, last seen on this clock), least recently used first."""
        self._expire()
        return [(session, key, seen) for session, (key, seen, _) in self._entries.items()]
