"""Which kept upstream connection an attempt uses: the pure bookkeeping of the warm connections.

Like httpcore's connection pool, the decisions are synchronous and free of I/O: the shell
(warm_conn.py) asks `assign(key)` and does what the answer says (use an open connection, wait
for one being dialled, dial a new one), then reports what happened (`opened`, `failed`,
`released`, `closed`). Keys name what a connection can serve: the upstream (scheme, host, port)
and the way to it (the route endpoint's proxy, if any). Credentials are not part of the key: they
are headers of each request, not properties of the connection. docs/architecture.md#warm-connections.

- HTTP/2 connections carry up to `max_streams` attempts at once; HTTP/1.1 ones one at a time.
- While a connection is being dialled, later attempts for the key wait for it and are assigned
  again once it is up, unless the key is known to speak HTTP/1.1 (then each dials its own).
- At most `max_idle_per_key` idle connections stay per key, each at most `idle_timeout` seconds,
  and at most `max_idle` in all (keys carry the credential: a client that uses many keys, or a
  large pool, never makes the proxy hold a connection for each).
- `prewarm(key)` dials one speculative connection when nothing usable or underway exists for the
  key, at most one at a time per key.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

DIALLING, OPEN, CLOSED = "dialling", "open", "closed"
MAX_STREAMS = 100  # HTTP/2 streams per connection (servers commonly allow 100-256)
MAX_IDLE_PER_KEY = 4
MAX_IDLE = 32  # idle connections kept in all, whatever the keys
IDLE_TIMEOUT = 300.0  # seconds; HTTP/2 keepalive PINGs keep a live one open (http2_ping_keepalive)



class WarmKey(NamedTuple):
    """What a kept connection can serve: the upstream, the way to it (mitmproxy's `via`) and the
    credential. Connections are kept per credential: one account's GOAWAY, reset or protocol error
    touches no other account's streams, and the upstream never sees two accounts multiplexed on one
    connection (which would link them).

    Whatever the client speaks, the connection offers HTTP/2 (unlike a plain mitmproxy, which
    mirrors the client's ALPN): on HTTP/1.1 a failover's cancelled attempt closes its connection,
    and the spare would wait for a handshake; on HTTP/2 it resets one stream (measured in
    docs/measurements.md, "HTTP/1.1 clients")."""

    scheme: str
    host: str
    port: int
    via: tuple[Literal["http", "https"], tuple[str, int]] | None  # an upstream proxy (a SOCKS one: its local bridge's)
    account: str = ""  # the credential (health key) it carries: one connection never carries two accounts

@dataclass(eq=False)
class Slot:
    """One upstream connection, as the book sees it."""

    key: Hashable
    id: int
    state: str = DIALLING
    multiplexed: bool | None = None  # HTTP/2; None until the connection is up
    active: int = 0  # attempts using it now
    idle_since: float | None = None
    speculative: bool = False  # dialled ahead of need (prewarm), not yet used

    def usable(self, max_streams: int) -> bool:
        if self.state != OPEN:
            return False
        return self.active < max_streams if self.multiplexed else self.active == 0


@dataclass(frozen=True)
class Use:
    slot: Slot  # open: send on it now


@dataclass(frozen=True)
class Dial:
    slot: Slot  # new: dial it (the caller's attempt is counted on it, unless speculative)


@dataclass(frozen=True)
class Await:
    slot: Slot  # being dialled: the attempt waits for it (counted on it); on HTTP/1.1 all but one dial their own


Assignment = Use | Dial | Await


@dataclass
class WarmBook:
    clock: Callable[[], float]
    max_streams: int = MAX_STREAMS
    max_idle_per_key: int = MAX_IDLE_PER_KEY
    max_idle: int = MAX_IDLE
    idle_timeout: float = IDLE_TIMEOUT
    slots: dict[Hashable, list[Slot]] = field(default_factory=dict)
    protocol: dict[Hashable, bool] = field(default_factory=dict)  # key -> multiplexed, once a connection told
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def assign(self, key: Hashable) -> Assignment:
        """Where the next attempt for `key` goes; a `Use` or `Dial` counts it on that slot."""
        slots = self.slots.setdefault(key, [])
        usable = [s for s in slots if s.usable(self.max_streams)]
        if usable:  # the busiest HTTP/2 one first (fewer connections), else the most recently idle
            slot = max(usable, key=lambda s: (s.active, s.idle_since or 0.0))
            self._take(slot)
            return Use(slot)
        for slot in slots:
            if slot.state == DIALLING and (slot.speculative or self.protocol.get(key, True)):
                self._take(slot)  # claimed: a key known to speak HTTP/1.1 dials its next attempt itself
                return Await(slot)
        slot = self._new(key)
        slot.active = 1
        return Dial(slot)

    def prewarm(self, key: Hashable) -> Dial | None:
        """A speculative dial when the next attempt for `key` would otherwise have to dial."""
        for slot in self.slots.get(key, []):
            if slot.usable(self.max_streams) or slot.state == DIALLING:
                return None
        slot = self._new(key)
        slot.speculative = True
        slot.idle_since = self.clock()
        return Dial(slot)

    def opened(self, slot: Slot, multiplexed: bool) -> None:
        if slot.state == DIALLING:
            slot.state, slot.multiplexed = OPEN, multiplexed
            self.protocol[slot.key] = multiplexed
            if slot.active == 0:
                slot.idle_since = self.clock()

    def failed(self, slot: Slot) -> None:
        """The dial failed: the slot is gone (waiters assign again and dial themselves)."""
        self.closed(slot)

    def released(self, slot: Slot) -> None:
        """An attempt on `slot` is over (its final hook ran)."""
        slot.active = max(0, slot.active - 1)
        if slot.active == 0:
            slot.idle_since = self.clock()

    def closed(self, slot: Slot) -> None:
        slot.state = CLOSED
        slots = self.slots.get(slot.key)
        if slots is not None and slot in slots:
            slots.remove(slot)
            if not slots:
                del self.slots[slot.key]

    def expired(self) -> list[Slot]:
        """Idle slots to close now: idle too long, or more idle ones for a key than allowed
        (the longest idle go first). The caller closes them and reports `closed`."""
        now, out, kept = self.clock(), [], []
        for slots in self.slots.values():
            idle = sorted((s for s in slots if s.state == OPEN and s.active == 0), key=lambda s: s.idle_since or 0.0)
            out += [s for s in idle if now - (s.idle_since or now) >= self.idle_timeout]
            fresh = [s for s in idle if s not in out]
            cut = max(0, len(fresh) - self.max_idle_per_key)
            out += fresh[:cut]
            kept += fresh[cut:]
        kept.sort(key=lambda s: s.idle_since or 0.0)
        return out + kept[: max(0, len(kept) - self.max_idle)]

    def all(self) -> list[Slot]:
        return [s for slots in self.slots.values() for s in slots]

    def _take(self, slot: Slot) -> None:
        slot.active += 1
        slot.speculative = False
        slot.idle_since = None

    def _new(self, key: Hashable) -> Slot:
        slot = Slot(key, next(self._ids))
        self.slots.setdefault(key, []).append(slot)
        return slot
