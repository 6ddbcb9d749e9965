"""The attempt engine: the kept upstream connections of the whole proxy (warm_conn.WarmConnection),
keyed by WarmKey; which one an attempt uses is the pure book's decision (core/warm_book.py).
docs/architecture.md#warm-connections."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Callable

from mitmproxy import ctx

from ..core.routes import Endpoint
from ..core.warm_book import CLOSED, OPEN, Dial, Slot, WarmBook, WarmKey
from ..net.socks_bridge import SocksBridges
from . import fallbacks
from .attempt import Attempt
from .own_conn import OwnConnection
from .warm_conn import WarmConnection

ENGINE_HOLDS = fallbacks.seam_holds("engine")

REAP_EVERY = 5.0  # seconds between looks for idle connections to close


class WarmConnections:
    """The attempt engine: the kept connections of the whole proxy, keyed by WarmKey (the book
    decides which one an attempt uses, warm_book.py), and the attempts that go over them."""

    def __init__(self, clock=time.monotonic):
        self.book = WarmBook(clock)
        self.handlers: dict[Slot, WarmConnection] = {}
        self.endpoints: dict[str, Endpoint | None] = {}  # client id of a kept connection -> its route endpoint
        self._reaper: asyncio.Task | None = None
        self.dials = 0  # connections dialled so far (status, tests)
        # The fallback's (SOCKS bridges, upstream TLS): the addon's.
        self.own_context: Callable[[], tuple[SocksBridges | None, ssl.SSLContext | None]] = lambda: (None, None)

    def connection_for(self, key: WarmKey, endpoint=None, dial_timeout: float = 30.0) -> WarmConnection:
        """The connection one attempt goes to (counted on it until `release`): an open one, one
        being dialled, or a new one its attempt dials. Bounded: a few reassignments at most. On the
        fallback, a connection of the attempt's own (own_conn.py)."""
        if not ENGINE_HOLDS:
            return OwnConnection(endpoint, dial_timeout, self.own_context)  # type: ignore[return-value]
        for _ in range(8):
            assignment = self.book.assign(key)
            conn = self.handlers.get(assignment.slot)
            if isinstance(assignment, Dial):
                return self._new(assignment.slot, key, endpoint, dial_timeout)
            if conn is not None and (conn.alive or conn.dialling and not conn.ready.done()):
                return conn
            self._forget(assignment.slot)  # died between uses: never counted against anyone
        raise RuntimeError("no upstream connection could be assigned")  # a bug: the book keeps changing its mind

    def attempt(self, client_flow, request, label: str, n: int) -> Attempt:
        """A new attempt (`request`, for `client_flow`) whose connection comes from here. The driver
        gets its attempts through this one method, so a test can inject a scripted engine."""
        return Attempt(client_flow, request, label, n, self)

    def prewarm(self, key: WarmKey, endpoint=None, dial_timeout: float = 30.0) -> None:
        """Dial one connection for `key` ahead of need if none is open or underway; nothing is sent."""
        if not ENGINE_HOLDS:
            return  # the fallback keeps no connection
        dial = self.book.prewarm(key)
        if dial is not None:
            conn = self._new(dial.slot, key, endpoint, dial_timeout)
            asyncio.get_running_loop().create_task(conn.dial())

    def own_connection(self, key: WarmKey, endpoint=None) -> WarmConnection:
        """A connection outside the book, for one WebSocket upgrade: its socket's, closed with it."""
        conn = WarmConnection(key, Slot(key, 0), ctx.options, endpoint)
        self.endpoints[conn.client.id] = endpoint  # its route's proxy credentials (http_connect_upstream)
        conn.on_closed = lambda c: self.endpoints.pop(c.client.id, None)
        self.dials += 1
        return conn

    def release(self, conn: WarmConnection) -> None:
        self.book.released(conn.slot)
        if conn.slot.state == CLOSED and not conn.attempts:
            conn.close()  # left the book (a pool change, a dial replaced) while in use

    def endpoint_of(self, client) -> Endpoint | None:
        return self.endpoints.get(client.id)

    def close_all(self) -> None:
        """A pool or route change: idle connections close now, busy ones once their attempts end."""
        for slot, conn in list(self.handlers.items()):
            self.book.closed(slot)
            if not conn.attempts:
                conn.close()

    def _new(self, slot: Slot, key: WarmKey, endpoint, dial_timeout: float) -> WarmConnection:
        conn = WarmConnection(key, slot, ctx.options, endpoint)
        conn.on_dialled = self._dialled
        conn.on_over = lambda c, a: self.release(c)
        conn.on_closed = self._closed
        conn.on_goaway = self._draining
        self.handlers[slot] = conn
        self.endpoints[conn.client.id] = endpoint
        self.dials += 1
        loop = asyncio.get_running_loop()
        # A dial that hangs is stopped a little after the attempts' own connect_timeout has acted.
        why = f"timed out connecting after {dial_timeout:g}s"
        loop.call_later(dial_timeout + 1.0, lambda: None if conn.ready.done() else conn.close(why))
        if self._reaper is None or self._reaper.done():
            self._reaper = loop.create_task(self._reap())
        return conn

    def _dialled(self, conn: WarmConnection) -> None:
        if conn.ready.result() is None:
            self.book.opened(conn.slot, conn.multiplexed)
        else:
            self.book.failed(conn.slot)

    def _draining(self, conn: WarmConnection) -> None:
        """A graceful GOAWAY: out of the book (a new attempt dials anew); closed after its last attempt."""
        self.book.closed(conn.slot)
        if not conn.attempts:
            conn.close()

    def _closed(self, conn: WarmConnection) -> None:
        self.book.closed(conn.slot)
        if self.handlers.get(conn.slot) is conn:
            del self.handlers[conn.slot]
        self.endpoints.pop(conn.client.id, None)

    def _forget(self, slot: Slot) -> None:
        conn = self.handlers.get(slot)
        self.book.closed(slot)
        if conn is not None and not conn.attempts:
            conn.close()

    async def _reap(self) -> None:
        while self.handlers:
            await asyncio.sleep(REAP_EVERY)
            for slot in self.book.expired():
                self._forget(slot)
            for slot, conn in list(self.handlers.items()):
                if not conn.dialling and not conn.alive and not conn.attempts:
                    self._forget(slot)

    def stats(self) -> dict[str, dict]:
        out: dict = {}
        for slot in self.book.all():
            key = slot.key
            assert isinstance(key, WarmKey)  # (the engine's book is keyed by WarmKey)
            entry = out.setdefault(f"{key.scheme}://{key.host}:{key.port}", {"open": 0, "active": 0})
            entry["open"] += slot.state == OPEN
            entry["active"] += slot.active
        return out
