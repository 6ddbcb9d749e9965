"""One WebSocket connection over an asyncio stream, either side, on wsproto: whole messages in
and out, pings answered at once, fragments joined. The gate's relay uses it towards mitmproxy
(server side) and for its own upstream sockets (client side)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from typing import Callable

from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection, ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from ..core.ws_turns import Message  # (content, is_text)
from .bounded_deflate import BoundedDeflate

log = logging.getLogger("codex_failover")

READ = 65536
ABNORMAL = 1006  # local-only: the peer vanished without a close frame
PROTOCOL_ERROR = 1002
MESSAGE_TOO_BIG = 1009
# Headers of the handshake itself: each hop negotiates its own.
HANDSHAKE_HEADERS = {"host", "connection", "upgrade", "sec-websocket-key", "sec-websocket-version",
                     "sec-websocket-extensions", "sec-websocket-protocol", "sec-websocket-accept", "content-length",
                     "transfer-encoding", "proxy-authorization", "proxy-connection", "keep-alive"}


class HandshakeRejected(Exception):
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes):
        super().__init__(f"upgrade answered HTTP {status}")
        self.status, self.headers, self.body = status, headers, body


class WsConn:
    # The largest message taken in either direction (the addon sets it from failover_max_body):
    # a larger one closes the connection with 1009, as WebSocket servers do.
    max_message = 32 * 1024 * 1024

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ws: WSConnection | Connection):
        self.reader, self.writer, self.ws = reader, writer, ws
        self.close_code: int | None = None  # set once the connection ended
        self.on_end: Callable[[int, str, bool], object] | None = None  # once it ended: (code, reason, closed by this side)
        self.close_reason = ""
        self.response_headers: list[tuple[bytes, bytes]] = []  # the peer's 101 headers (client side)
        self._events: deque[Event] = deque()
        self._parts: list = []
        self._size = 0  # of the message being received

    # -- handshakes ------------------------------------------------------------------------

    @classmethod
    async def connect(cls, reader, writer, host: str, target: str, headers: list[tuple[bytes, bytes]],
                      deflate: bool = True, max_reject_body: int = 65536) -> "WsConn":
        """Client side: send the upgrade, wait for 101 (HandshakeRejected otherwise)."""
        conn = cls(reader, writer, WSConnection(ConnectionType.CLIENT))
        extensions = [BoundedDeflate(cls.max_message)] if deflate else []
        writer.write(conn.ws.send(Request(host=host, target=target, extra_headers=headers, extensions=extensions)))
        await writer.drain()
        rejected: RejectConnection | None = None
        body = bytearray()
        while True:
            event = await conn._next_event()
            if event is None:
                if rejected is not None:
                    raise HandshakeRejected(rejected.status_code, list(rejected.headers), bytes(body))
                raise ConnectionError("upstream closed during the WebSocket handshake")
            if isinstance(event, AcceptConnection):
                conn.response_headers = list(event.extra_headers)
                return conn
            if isinstance(event, RejectConnection):
                rejected = event
                if not event.has_body:
                    raise HandshakeRejected(event.status_code, list(event.headers), b"")
            elif isinstance(event, RejectData) and rejected is not None:
                body += event.data[: max_reject_body - len(body)]
                if event.body_finished:
                    raise HandshakeRejected(rejected.status_code, list(rejected.headers), bytes(body))

    @classmethod
    def accept(cls, head: bytes, reader, writer, headers: list[tuple[bytes, bytes]]) -> "WsConn":
        """Server side, for a request head already read: answer 101 with `headers`."""
        conn = cls(reader, writer, WSConnection(ConnectionType.SERVER))
        conn.ws.receive_data(head)
        request = next((e for e in conn.ws.events() if isinstance(e, Request)), None)
        if request is None:
            raise ConnectionError("not a WebSocket upgrade")
        # Compression on this loopback hop when the client offered it, as mitmproxy negotiates it for any
        # WebSocket: mitmproxy joins a frame's pieces quadratically (websocket.py:172), and a compressed
        # frame arrives in far fewer pieces (a 64 MiB message: 2.5 s instead of 21 s). docs/architecture.md.
        offered = any(str(getattr(e, "name", e)).startswith("permessage-deflate") for e in request.extensions or [])
        writer.write(conn.ws.send(AcceptConnection(extra_headers=headers,
                                                   extensions=[BoundedDeflate(cls.max_message)] if offered else [])))
        return conn

    # -- messages --------------------------------------------------------------------------

    async def recv(self) -> Message | None:
        """The next whole message; None once the connection has ended (see close_code)."""
        while True:
            event = await self._next_event()
            if event is None:
                return None
            if isinstance(event, (TextMessage, BytesMessage)):
                self._parts.append(event.data)
                self._size += len(event.data)
                if self._size > self.max_message:
                    self._parts, self._size = [], 0
                    self.close(MESSAGE_TOO_BIG, "message too big")
                    return None
                if event.message_finished:
                    parts, self._parts, self._size = self._parts, [], 0
                    if isinstance(event, TextMessage):
                        return "".join(parts).encode(), True
                    return b"".join(parts), False
            elif isinstance(event, Ping) and self.ws.state is ConnectionState.OPEN:
                self._write(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if self.ws.state is ConnectionState.OPEN:  # wsproto's verdict on bad input, not a peer's
                    # close (e.g. 1009 from BoundedDeflate): the peer is told, as for our own checks
                    self.close(event.code, "message too big" if event.code == MESSAGE_TOO_BIG else event.reason or "")
                    return None
                self._closed(event.code, event.reason or "")
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    self._write(self.ws.send(event.response()))
                self._shutdown()
                return None

    async def send(self, message: Message) -> None:
        content, is_text = message
        if self.ws.state is not ConnectionState.OPEN:
            return
        event = TextMessage(data=content.decode("utf-8", "replace")) if is_text else BytesMessage(data=content)
        self._write(self.ws.send(event))
        try:
            await self.writer.drain()  # backpressure: a slow reader slows its source
        except (ConnectionError, ssl.SSLError):
            self._closed(ABNORMAL, "connection lost")

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (if still open) and end the connection. Never raises."""
        if self.ws.state is ConnectionState.OPEN:
            try:
                self._write(self.ws.send(CloseConnection(code=code, reason=reason)))
            except Exception:  # noqa: BLE001 - the socket is going away either way
                pass
        self._closed(code, reason, True)
        self._shutdown()

    @property
    def open(self) -> bool:
        return self.close_code is None

    # -- internals -------------------------------------------------------------------------

    async def _next_event(self) -> Event | None:
        while not self._events:
            if self.close_code is not None:
                return None
            try:
                data = await self.reader.read(READ)
            except (ConnectionError, ssl.SSLError) as exc:
                # An SSLError here is a peer that broke TLS while going away, e.g. an upstream that
                # writes after its close_notify (APPLICATION_DATA_AFTER_CLOSE_NOTIFY) as a socket
                # shuts down: the connection has ended, which is news only at debug level.
                log.debug("websocket: connection ended: %r", exc)
                data = b""
            if not data:
                self._closed(ABNORMAL, "connection lost")
                self._shutdown()
                return None
            try:
                self.ws.receive_data(data)
                self._events.extend(self.ws.events())
            except RemoteProtocolError:
                self._closed(PROTOCOL_ERROR, "protocol error")
                self._shutdown()
                return None
        return self._events.popleft()

    def _closed(self, code: int, reason: str, by_us: bool = False) -> None:
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
            if self.on_end is not None:
                self.on_end(code, reason, by_us)

    def _write(self, data: bytes) -> None:
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def _shutdown(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
