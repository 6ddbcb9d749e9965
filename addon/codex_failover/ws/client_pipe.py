"""The gated socket's client side in process: the gate's `down` (`InProcessClient`, WsConn's interface)
is the client flow's own WebSocket layer, through the held flow's stand-in (mitm/held_stream.py's `upgrade`),
not a loopback socket.

Each message is framed once each way, by mitmproxy's WebSocket layer: Codex's are parsed there, run
`websocket_message`, and come to the gate whole once every addon saw them (held_layer.py takes them at
that hook's end, so the layer sends them no further); the gate's go into the layer whole, run their
hooks and are framed toward Codex (`HeldStream.send_message`). Only control frames cross the stand-in:
Codex's pings (answered here) and close, and the gate's close with its code. Toward the client,
permessage-deflate is negotiated when offered, as the relay did; the inside hop is uncompressed (its
deflate is cleared at `websocket_start`, `held_stream.ws_started`). The relay (net/relay.py) is the
fallback (`hop` in mitm/fallbacks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from wsproto import ConnectionType
from wsproto.connection import Connection, ConnectionState
from wsproto.events import CloseConnection, Message, Ping
from wsproto.extensions import PerMessageDeflate
from wsproto.handshake import server_extensions_handshake
from wsproto.utilities import RemoteProtocolError, generate_accept_token, split_comma_header

from ..core.turn_machine import INTERNAL_CLOSE
from ..core.ws_turns import Message as Whole
from .conn import ABNORMAL, HANDSHAKE_HEADERS, MESSAGE_TOO_BIG, PROTOCOL_ERROR, WsConn

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


class InProcessClient:
    """The gate's client socket in process (see the module's docstring), with WsConn's interface:
    `recv`, `send`, `close`, `open`, `close_code`. `took` and `control` are the layers' side."""

    def __init__(self, hop):
        self.hop = hop  # the held client stream (mitm/held_stream.py's HeldStream)
        self.control_ws = Connection(ConnectionType.SERVER)  # the stand-in's end: control frames only
        self.close_code: int | None = None
        self.close_reason = ""
        self._inbox: deque[Whole] = deque()
        self._waiting = 0  # bytes of the messages in the inbox
        self._waiter: asyncio.Future | None = None
        self._ended = False  # the stand-in's end was written

    # -- the layers' side ------------------------------------------------------------------

    def took(self, content: bytes, is_text: bool) -> None:
        """A whole message of Codex's, after every addon saw it. Past WsConn.max_message, or when more than
        twice that waits unread by the gate (a client that keeps sending while the gate cannot take it):
        closed with 1009."""
        if self.close_code is not None:
            return
        if len(content) > WsConn.max_message or self._waiting + len(content) > 2 * WsConn.max_message:
            log.warning("codex-failover: the client sent a WebSocket message of %d bytes (%d unread before it), "
                        "over failover_max_body (%d): closing with 1009", len(content), self._waiting,
                        WsConn.max_message)
            self.close(MESSAGE_TOO_BIG, "message too big")
            return
        self._inbox.append((content, is_text))
        self._waiting += len(content)
        self._wake()

    def control(self, data: bytes) -> None:
        """Frames the client's layer sends on toward the stand-in (b"": the client is gone): control frames."""
        if self.close_code is not None:
            return
        if not data:
            self._closed(ABNORMAL, "connection lost")
            return
        try:
            self.control_ws.receive_data(data)
            events = list(self.control_ws.events())
        except RemoteProtocolError:
            self._closed(PROTOCOL_ERROR, "protocol error")
            self._end()
            return
        for event in events:
            if isinstance(event, Ping) and self.control_ws.state is ConnectionState.OPEN:
                self.hop.write(self.control_ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self._closed(event.code, event.reason or "")
                if self.control_ws.state is ConnectionState.REMOTE_CLOSING:
                    self.hop.write(self.control_ws.send(event.response()))
                self._end()
            elif isinstance(event, Message):  # a message framed on toward the stand-in: the layers are not as pinned
                log.warning("codex-failover: a gated WebSocket's message reached its stand-in; closing it")
                self.close(INTERNAL_CLOSE, "codex-failover: internal error")
                return

    # -- the gate's side (WsConn's interface) ------------------------------------------------

    async def recv(self) -> Whole | None:
        """The next whole message; None once the socket has ended (see close_code)."""
        while not self._inbox:
            if self.close_code is not None:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._inbox.popleft()
        self._waiting -= len(message[0])
        return message

    async def send(self, message: Whole) -> None:
        if self.close_code is None:
            try:
                await self.hop.send_message(*message)
            except (ConnectionError, OSError):  # the client went while its socket drained
                self._closed(ABNORMAL, "connection lost")
                self._end()

    def close(self, code: int = 1000, reason: str = "") -> None:
        """A close frame from the server side (mitmproxy's layer closes the client with its code); never raises."""
        if self.control_ws.state is ConnectionState.OPEN:
            with contextlib.suppress(Exception):  # a code the protocol does not send: the socket goes all the same
                self.hop.write(self.control_ws.send(CloseConnection(code=code, reason=reason)))
        self._closed(code, reason)
        self._end()

    @property
    def open(self) -> bool:
        return self.close_code is None

    def _closed(self, code: int, reason: str) -> None:
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
            self._wake()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.hop.write(b"")  # the server side closed: mitmproxy's WebSocket layer ends the client's

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def serve_in_process(session, hop) -> None:
    """A gated session (ws/gate.py) served in the client's own layers: the hop answers 101, then
    mitmproxy's WebSocket layer carries the messages both ways, each framed once."""
    client = InProcessClient(hop)
    hop.upgrade(upgrade_headers(session.flow.request.headers, session.relay_headers()), client.control, client.took)
    session.down = client
    try:
        await session.run()
    finally:
        session.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hop.drained(), 5)  # the close frame reaches the client
        hop.detach()
