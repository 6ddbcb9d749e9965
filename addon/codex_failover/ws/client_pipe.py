"""The gated socket's client side in process: the gate's `WsConn` reads and writes the client's own
layers through the held flow's stand-in (mitm/held_stream.py's `upgrade`), not a loopback socket.

mitmproxy's WebSocket layer runs between Codex and the stand-in as it would between Codex and a
server: it parses Codex's frames, runs `websocket_message` on the client flow, and sends the frames
on toward the stand-in, whose bytes land here (`PipeReader.feed`); what the gate writes goes back
the same way (`PipeWriter.write` -> `HeldStream.write`). Toward the client, permessage-deflate is
negotiated when offered, as the relay did: mitmproxy's layer joins a frame's pieces quadratically, and
a large compressed message arrives in far fewer pieces. The inside hop (mitmproxy's layer and the
stand-in) is uncompressed: its deflate is cleared at `websocket_start` (`held_stream.ws_started`).
The relay (net/relay.py) is the fallback (`hop` in mitm/fallbacks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Callable

from wsproto.extensions import PerMessageDeflate
from wsproto.handshake import server_extensions_handshake
from wsproto.utilities import generate_accept_token, split_comma_header

from .conn import HANDSHAKE_HEADERS, MESSAGE_TOO_BIG, READ, WsConn

log = logging.getLogger("codex_failover")


def upgrade_headers(request_headers, upstream_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's 101: the handshake's own headers (its key's accept token; permessage-deflate
    when the client offered it, as the relay and mitmproxy answer) and the upstream's others."""
    key = request_headers.get("sec-websocket-key", "").encode("latin-1", "replace")
    own = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"), (b"sec-websocket-accept", generate_accept_token(key))]
    offers = [o for value in request_headers.get_all("sec-websocket-extensions") for o in split_comma_header(value.encode())]
    accepted = server_extensions_handshake(offers, [PerMessageDeflate()]) if offers else None
    if accepted:
        own.append((b"sec-websocket-extensions", accepted))
    return own + [(k, v) for k, v in upstream_headers if k.decode("latin-1").lower() not in HANDSHAKE_HEADERS]


class PipeReader:
    """What `WsConn` reads (`read`), fed by the stand-in (b"": the client is gone). Bounded: a piece
    that arrives while more than `limit` bytes wait unread calls `on_over` once (the gate closes the
    socket) and is not taken."""

    def __init__(self, limit: int, on_over: Callable[[], object]):
        self.limit, self.on_over = limit, on_over
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._waiter: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        if self._eof:
            return
        if data and self._size > self.limit:  # a piece is taken whole (mitmproxy's layer holds it already); a pile-up is not
            self._eof = True  # nothing more is taken
            self.on_over()
        elif data:
            self._chunks.append(data)
            self._size += len(data)
        else:
            self._eof = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self, n: int) -> bytes:
        while not self._chunks:
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        if len(data) > n:
            data, rest = data[:n], data[n:]
            self._chunks.appendleft(rest)
        self._size -= len(data)
        return data


class PipeWriter:
    """What `WsConn` writes: each write goes to the client's layers in order (`HeldStream.write`)."""

    def __init__(self, hop):
        self.hop = hop
        self._closing = False

    def write(self, data: bytes) -> None:
        if data and not self._closing:
            self.hop.write(data)

    async def drain(self) -> None:
        await self.hop.drained()

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self.hop.write(b"")  # the server side closed: mitmproxy's WebSocket layer ends the client's

    def is_closing(self) -> bool:
        return self._closing or self.hop.gone


async def serve_in_process(session, hop) -> None:
    """A gated session (ws/gate.py) served in the client's own layers: the hop answers 101, then
    mitmproxy's WebSocket layer carries the frames both ways."""

    def over() -> None:
        log.warning("[%s] the client sent more than %d bytes the gate had not yet read (a message over "
                    "failover_max_body?): closing with 1009", session.sid, limit)
        session.down.close(MESSAGE_TOO_BIG, "message too big")
        session.abort()

    limit = 2 * WsConn.max_message + READ
    reader = PipeReader(limit, over)
    hop.upgrade(upgrade_headers(session.flow.request.headers, session.relay_headers()), reader.feed)
    session.down = WsConn.opened(reader, PipeWriter(hop))
    try:
        await session.run()
    finally:
        session.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hop.drained(), 5)  # the close frame reaches the client
        hop.detach()
