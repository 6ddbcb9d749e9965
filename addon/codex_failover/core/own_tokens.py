"""The clients' own ChatGPT tokens that the usage re-check asks with (held in memory only). Pure.

A client's own account is keyed by the account it names (`planner.client_key`: the
chatgpt-account-id header and the token's claims), and those claims are not verified here: any
client can send a token that claims another's account. So a newly seen token never replaces the
one held for its key. It waits beside it (`newest`), is tried first at the next re-check, and
replaces the held one only once the upstream answered it 2xx; refused (401/403), it is dropped and
the held one asked. The rule, and why it is the simplest sound one: the upstream is the only judge
of a token this proxy has (it cannot check the signature), the re-check asks the upstream anyway,
and a forged token costs one refused GET instead of the real client's re-check.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

ACCEPTED = "accepted"  # a 2xx with it
REFUSED = "refused"  # 401/403: not a token of that account (forged, revoked, expired)
OTHER = "other"  # anything else says nothing about the token


@dataclass
class _Slot(Generic[T]):
    held: T | None = None  # the upstream accepted it
    newest: T | None = None  # seen since, not yet judged


class OwnTokens(Generic[T]):
    """Per key, the token the upstream accepted and the newest one seen; at most `limit` keys
    (least recently seen out first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots: OrderedDict[str, _Slot[T]] = OrderedDict()

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._slots))

    def __len__(self) -> int:
        return len(self._slots)

    def saw(self, key: str, token: T) -> None:
        slot = self._slots.setdefault(key, _Slot())
        self._slots.move_to_end(key)
        if token != slot.held:
            slot.newest = token
        while len(self._slots) > self.limit:
            self._slots.popitem(last=False)

    def to_try(self, key: str) -> list[T]:
        """What to ask with, in order: the newest seen (if any), then the accepted one."""
        slot = self._slots.get(key)
        if slot is None:
            return []
        return [t for t in (slot.newest, slot.held) if t is not None]

    def answered(self, key: str, token: T, verdict: str) -> None:
        slot = self._slots.get(key)
        if slot is None:
            return
        if verdict == ACCEPTED and token == slot.newest:
            slot.held, slot.newest = token, None
        elif verdict == REFUSED:
            if token == slot.newest:
                slot.newest = None
            elif token == slot.held:
                slot.held = None


def verdict(status: int) -> str:
    return ACCEPTED if 200 <= status < 300 else REFUSED if status in (401, 403) else OTHER
