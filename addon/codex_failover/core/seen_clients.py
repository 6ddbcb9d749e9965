"""The clients' own credentials seen recently, by a non-secret label, for the status page and
`failover.status` (a client's overloaded key is skipped like a pooled one: show why). Pure."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from .auth import CHATGPT, AuthMaterial
from .planner import client_key

MAX_SEEN = 32  # bounded: the oldest is forgotten first
RECENT = 24 * 3600.0  # not listed once unseen this long


def label(auth: AuthMaterial) -> str:
    """`account …1a2b` (ChatGPT login: the account id's last 4 characters) or `key #1a2b3c4d` (a
    prefix of the key's SHA-256): enough to tell them apart, nothing to reuse."""
    if auth.kind == CHATGPT and auth.account_id:
        return f"account …{auth.account_id[-4:]}"
    return f"key #{auth.fingerprint[:8]}"


class SeenClients:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._seen: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # health key -> (label, kind, when)

    def saw(self, auth: AuthMaterial, key: str | None = None) -> None:
        key = key or client_key(auth)
        self._seen[key] = (label(auth), auth.kind, self._clock())
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def recent(self) -> list[tuple[str, str, str, float]]:
        """(health key, label, kind, seconds since seen), most recent first."""
        now = self._clock()
        return [(key, name, kind, now - when) for key, (name, kind, when) in reversed(self._seen.items())
                if now - when <= RECENT]
