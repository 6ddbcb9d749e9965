"""Attempts over kept upstream connections, by mitmproxy's own HTTP layers (docs/architecture.md#warm-
connections; facts relied on: docs/mitmproxy-12.3.1-replay-notes.md §9, §13). A `WarmConnection` is a
`ConnectionHandler` living as long as its upstream connection: mitmproxy's `HttpLayer` with
`_AttemptSource` as "client", each attempt a request on a stream of its own run by `HttpStream` with
every addon hook; `_KeptHttpLayer.get_connection` answers with the kept connection. A WebSocket
upgrade has a connection of its own and goes on in mitmproxy's WebSocket layer (ws/layer_socket.py).
Secrets: placeholders on the flow, the real values only while the upstream's layers write the head."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import h2.connection
import h2.errors
import h2.events
from mitmproxy import ctx, flow as mitmflow, websocket
from mitmproxy.connection import Client, ConnectionState, Server
from mitmproxy.proxy import commands, events, layer, server, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import HTTPMode, HttpStream
from mitmproxy.proxy.layers.websocket import (
    WebsocketEndHook,
    WebsocketLayer,
    WebsocketMessageHook,
    WebSocketMessageInjected,
    WebsocketStartHook,
)
from wsproto.events import BytesMessage, TextMessage
from wsproto.frame_protocol import Opcode

from ..core.warm_book import Slot, WarmKey
from . import fallbacks
from .carried import Carried, CarriedSocket
from .http11 import as_http11
from .quiet_log import replay_level

try:  # GOAWAYs stream by stream where mitmproxy's HTTP/2 client is as pinned (test_warm_conn_contract.py)
    from mitmproxy.proxy.layers.http._http2 import Http2Client
    BY_STREAM = fallbacks.seam_holds("goaway")
except ImportError:  # another mitmproxy: its own GOAWAY handling
    Http2Client, BY_STREAM = None, False  # type: ignore[assignment,misc]

class _Dial(events.ConnectionEvent):
    pass


@dataclass
class _Submit(events.ConnectionEvent):
    attempt: Carried


@dataclass
class _ToStream(events.ConnectionEvent):
    stream_id: int
    message: str = ""
    data: bytes | None = None  # (with data: frames of an upgraded stream's client side, `feed`)


class WholeMessage(WebSocketMessageInjected):
    """A whole message the gate sends on one of mitmproxy's WebSocket layers: toward the upstream on an
    upgraded attempt's (`from_client`), toward Codex on the client's own (held_layer.StreamWire)."""

    @classmethod
    def of(cls, flow: mitmflow.Flow, content: bytes, is_text: bool, from_client: bool) -> "WholeMessage":
        """`content` as one message of `flow`'s socket: the gate's, toward the upstream (`from_client`)
        or toward Codex."""
        kind = Opcode.TEXT if is_text else Opcode.BINARY
        return cls(flow, websocket.WebSocketMessage(kind, from_client, content, injected=True))


class WholeMessageLayer(WebsocketLayer):
    """mitmproxy's WebSocket layer taking the gate's messages whole (`WholeMessage`): each runs
    `websocket_message`, then is framed once toward its peer, as the layer relays a message it parsed.
    mitmproxy's own injection would split a text at 4,000 bytes and decode each piece alone, breaking a
    character across the split. Everything else is the layer's own (what it parses, pings, the close)."""

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not isinstance(event, WholeMessage):
            yield from super().relay_messages(event)
            return
        assert self.flow.websocket is not None  # (after websocket_start)
        message = event.message
        self.flow.websocket.messages.append(message)
        yield WebsocketMessageHook(self.flow)
        if not message.dropped:
            peer = self.server_ws if message.from_client else self.client_ws
            yield peer.send2(TextMessage(message.content.decode("utf-8", "replace")) if message.is_text
                             else BytesMessage(message.content))


def takes_whole_messages(child: object) -> bool:
    """Make `child`, mitmproxy's WebSocket layer at its `websocket_start` (it binds its relay once the
    hook returns), take whole messages. False when it is not that layer (not as pinned)."""
    if type(child) is WebsocketLayer:
        child.__class__ = WholeMessageLayer
    return type(child) is WholeMessageLayer


class _AttemptSource(layer.Layer):
    """The HTTP layer's client: hands attempts over as requests, asks for dials, ignores responses (each
    attempt reads its own from its hooks); never pauses. After an upgrade, the socket's client side."""

    def __init__(self, context: Context, owner: "WarmConnection"):
        super().__init__(context)
        self.owner = owner

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, _Dial):
            key = self.owner.key
            yield http_layers.GetHttpConnection((key.host, key.port), key.scheme == "https", key.via)
        elif isinstance(event, http_layers.GetHttpConnectionCompleted):
            pass  # a prewarm's dial: the layer told the owner already (register_connection)
        elif isinstance(event, _Submit):
            yield from self._submit(event.attempt)
        elif isinstance(event, _ToStream) and event.data is not None:
            yield http_layers.ReceiveHttp(http_layers.RequestData(event.stream_id, event.data))
        elif isinstance(event, _ToStream):
            error = http_layers.RequestProtocolError(event.stream_id, event.message, http_layers.ErrorCode.CANCEL)
            yield http_layers.ReceiveHttp(error)
        elif isinstance(event, http_layers.ResponseData) and event.stream_id in self.owner.sockets:
            self.owner.sockets[event.stream_id].from_layers(event.data)  # its frames for the client side

    def _submit(self, attempt: Carried) -> layer.CommandGenerator[None]:
        """As mitmproxy's replay MockServer does: the whole request, on the attempt's stream."""
        request, sid = attempt.flow.request, attempt.stream_id
        content = request.raw_content
        request.timestamp_start = request.timestamp_end = time.time()
        yield http_layers.ReceiveHttp(http_layers.RequestHeaders(sid, request, end_stream=not content,
                                                                 replay_flow=attempt.flow))
        if content:
            yield http_layers.ReceiveHttp(http_layers.RequestData(sid, content))
        yield http_layers.ReceiveHttp(http_layers.RequestEndOfMessage(sid))

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:  # pragma: no cover
        yield from ()


NEVER_PROCESSED = "HTTP/2 GOAWAY: the server never processed this stream"  # safe to resend (core/transport.py)


class _GoawayHttp2Client(Http2Client or object):  # type: ignore[misc]
    """A kept connection's HTTP/2 layer (swapped in): mitmproxy closes on any GOAWAY, h2 refuses frames
    after one. Here streams above last_stream_id fail as never processed, kept ones are read to the end."""

    warm: "WarmConnection"

    def handle_h2_event(self, event: h2.events.Event) -> layer.CommandGenerator[bool]:
        if not isinstance(event, h2.events.ConnectionTerminated):
            return (yield from super().handle_h2_event(event))
        last = event.last_stream_id or 0
        for stream_id in [s for s in self.streams if s > last]:
            yield http_layers.ReceiveHttp(self.ReceiveProtocolError(stream_id, NEVER_PROCESSED, self.ReceiveProtocolError.code))
            self.streams.pop(stream_id)
        if event.error_code != h2.errors.ErrorCodes.NO_ERROR or not self.streams:
            return (yield from super().handle_h2_event(event))
        self.h2_conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN  # frames of kept streams pass
        self.warm.goaway()
        return False


class _KeptHttpLayer(http_layers.HttpLayer):
    """mitmproxy's HttpLayer sharing the kept connection, the secrets armed only inside its layers."""

    def __init__(self, context: Context, owner: "WarmConnection"):
        super().__init__(context, HTTPMode.transparent)
        self.owner = owner

    def get_connection(self, event, *, reuse: bool = True) -> layer.CommandGenerator[None]:
        """The kept connection for the kept upstream: waited for while dialled, used once up, dialled if
        none (or closed). Anything else (a hook sent it elsewhere) gets one of its own, closed after it."""
        owner, kept = self.owner, self.owner.kept
        busy = kept is not None and kept.connected and any(  # HTTP/1.1 and in use (the book assigned it mid-dial)
            isinstance(c, http_layers.Http1Client) and c.stream_id is not None for c in owner.below(self.connections.get(kept)))
        if (busy or not event.connection_spec_matches(owner.spec)) and not (owner.sockets and kept is None):
            yield from super().get_connection(event, reuse=False)
            return
        if kept is not None and kept in self.waiting_for_establishment:
            self.waiting_for_establishment[kept].append(event)
            return
        if kept is not None and (kept.connected or kept.error):
            reply = (kept, None) if kept.connected else (None, kept.error or "")
            yield from self.event_to_child(self.command_sources.pop(event), http_layers.GetHttpConnectionCompleted(event, reply))
            return
        known = set(self.connections)
        yield from super().get_connection(event, reuse=False)
        new = next((c for c in self.connections if c not in known), None)
        owner.kept = new if isinstance(new, Server) else None  # (the server connection it made)

    def register_connection(self, command) -> layer.CommandGenerator[None]:
        """The kept connection is up (or failed): every waiting attempt gets it; on HTTP/1.1 only the first."""
        waiting = self.waiting_for_establishment.get(command.connection, [])
        own = []
        if not command.err and command.connection.alpn != b"h2" and command.connection is self.owner.kept:
            own, waiting[1:] = waiting[1:], []
        yield from super().register_connection(command)
        if command.connection is self.owner.kept:
            self.owner.dialled(None if command.err else command.connection, command.err)
        for cmd in own:
            yield from super().get_connection(cmd, reuse=False)

    def event_to_child(self, child, event: events.Event) -> layer.CommandGenerator[None]:
        if self.owner.sockets and isinstance(event, events.DataReceived) and event.connection is self.owner.kept:
            for socket in self.owner.sockets.values():  # a WebSocket counts what it reads (its bound)
                socket.received(len(event.data))
        if not self.owner.h2_seen and BY_STREAM and child is not self.owner.source and not isinstance(child, HttpStream):
            self._graceful(child)
        if isinstance(child, HttpStream):
            if isinstance(event, http_layers.GetHttpConnectionCompleted):
                connection, _ = event.reply
                if self.owner.abandoned(child.stream_id):  # cancelled while it waited: it never gets it
                    event = http_layers.GetHttpConnectionCompleted(event.command, (None, mitmflow.Error.KILLED_MESSAGE))
                elif connection is not None and connection.alpn != b"h2":
                    as_http11(child.flow.request)
            yield from super().event_to_child(child, event)
            return
        unsent = self.owner.unsent() if child is not self.owner.source else ()
        if not unsent:
            yield from super().event_to_child(child, event)
            return
        for attempt in unsent:
            attempt.arm()
        try:
            produced = list(super().event_to_child(child, event))
        finally:
            for attempt in unsent:
                if self.owner.head_written(attempt):
                    attempt.mark_sent()
                attempt.redact()
        yield from produced

    def _graceful(self, child) -> None:
        """The kept connection's HTTP/2 layer, once it exists, takes GOAWAYs stream by stream."""
        for below in self.owner.below(child):  # TLS, an upstream proxy's tunnel, HttpClient, Http2Client
            if type(below) is Http2Client:
                below.__class__, self.owner.h2_seen = _GoawayHttp2Client, True
                below.warm = self.owner  # type: ignore[attr-defined]  # (a _GoawayHttp2Client's, now its class)
        kept = self.owner.kept  # up (TLS done), and not HTTP/2: nothing to look for on its every read
        self.owner.h2_seen |= kept is not None and kept.connected and kept.tls_established == kept.tls and kept.alpn != b"h2"


class WarmConnection(server.ConnectionHandler):
    """One kept upstream connection, run by mitmproxy's HTTP layers; attempts are sent over it."""

    layer: _KeptHttpLayer

    def __init__(self, key: WarmKey, slot: Slot, options, endpoint=None):
        client = Client(peername=("127.0.0.1", 0), sockname=("127.0.0.1", 0), state=ConnectionState.OPEN)
        if options.http2:  # mirrored upstream by mitmproxy's TlsConfig: HTTP/2 where the upstream offers it
            client.alpn_offers = [b"h2", b"http/1.1"]
        context = Context(client, options)
        context.server = Server(address=(key.host, key.port), via=key.via)
        if key.scheme == "https":
            context.server.tls, context.server.sni = True, key.host
        super().__init__(context)
        self.key, self.slot, self.endpoint = key, slot, endpoint
        self.spec = Server(address=(key.host, key.port), via=key.via)  # what the kept connection serves
        self.spec.tls = key.scheme == "https"
        self.layer = _KeptHttpLayer(context, self)
        self.source = _AttemptSource(context.fork(), self)
        self.layer.connections[client] = self.source
        self.attempts: dict[int, Carried] = {}  # stream id -> attempt under way
        self.sockets: dict[int, CarriedSocket] = {}  # stream id -> a WebSocket upgrade's attempt (ws/layer_socket.py)
        self.kept: Server | None = None  # the kept connection, from its dial on
        self.ready: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()  # the dial's error, or None
        self._stream_ids = itertools.count(1, 2)
        self._started = False
        self.h2_seen = False  # its HTTP/2 layer was found (and swapped: _GoawayHttp2Client), or it is not HTTP/2
        self.draining = False  # a graceful GOAWAY came: the streams it kept go on, no new attempt comes
        self.on_dialled: Callable[[WarmConnection], object] | None = None  # once the dial ended (either way)
        self.on_goaway: Callable[[WarmConnection], object] | None = None  # on a graceful GOAWAY
        self.on_over: Callable[[WarmConnection, Carried], object] | None = None  # an attempt's final hook ran
        self.on_closed: Callable[[WarmConnection], object] | None = None  # once the connection is gone

    async def _start(self) -> None:
        if not self._started:
            self._started = True
            await self.server_event(events.Start())

    async def dial(self) -> None:
        """Open the connection ahead of need (TCP, tunnel, TLS); `ready` tells how it ended."""
        await self._start()
        await self.server_event(_Dial(self.client))

    def dialled(self, connection: Server | None, error: str | None) -> None:
        """From the layers (synchronous): the dial's outcome."""
        if not self.ready.done():
            self.ready.set_result(error if connection is None else None)
        if self.on_dialled is not None:
            self.on_dialled(self)
        if connection is None:
            self._gone()

    @property
    def alive(self) -> bool:
        kept = self.kept
        return kept is not None and bool(kept.state & ConnectionState.CAN_READ) and bool(kept.state & ConnectionState.CAN_WRITE)

    @property
    def dialling(self) -> bool:
        return self.kept is None or not self.ready.done()

    @property
    def multiplexed(self) -> bool:
        return self.kept is not None and self.kept.alpn == b"h2"

    def goaway(self) -> None:
        """From the layers (synchronous): a graceful GOAWAY; no new attempt goes to this connection."""
        if not self.draining:
            self.draining = True
            self.log("graceful GOAWAY: its streams go on, new attempts dial anew", logging.DEBUG)
            if self.on_goaway is not None:
                self.on_goaway(self)

    def close(self, why: str = "closed by codex-failover") -> None:
        """Close the connection (or stop its dial: `why` is then the waiting attempts' error)."""
        for io in list(self.transports.values()):
            if io.handler is not None:
                io.handler.cancel(why)
        if not self.transports:
            if not self.ready.done():
                self.ready.set_result(why)
            self._gone()

    def _gone(self) -> None:
        callback, self.on_closed = self.on_closed, None
        if callback is not None:
            callback(self)

    async def submit(self, attempt: Carried, socket: CarriedSocket | None = None) -> None:
        """Send an attempt; a WebSocket upgrade's (`socket`: the attempt) is told each hook, read and frame."""
        await self._start()
        attempt.stream_id = next(self._stream_ids)
        self.attempts[attempt.stream_id] = attempt
        if socket is not None:
            self.client.alpn_offers = [b"http/1.1"]  # the upgrade is HTTP/1.1's
            self.sockets[attempt.stream_id] = socket
        await self.server_event(_Submit(self.client, attempt))

    async def send_message(self, attempt: Carried, content: bytes, is_text: bool) -> None:
        """A whole message from an upgraded attempt's client side into its WebSocket layer (framed once
        there, `WholeMessageLayer`), then written out (drained)."""
        await self.server_event(WholeMessage.of(attempt.flow, content, is_text, from_client=True))
        await self.drain_writers()

    async def feed(self, attempt: Carried, data: bytes) -> None:
        """Frames from an upgraded attempt's client side (its control frames: pongs, the close) into the
        layers, then written out (drained)."""
        await self.server_event(_ToStream(self.client, attempt.stream_id, data=data))
        await self.drain_writers()

    def _whole_messages(self, attempt: Carried) -> None:
        """At an upgraded attempt's `websocket_start`: its WebSocket layer takes the gate's messages whole.
        Where the layers are not as pinned, the socket is closed (mitmproxy's own injection would split a
        text at 4,000 bytes, each piece decoded alone)."""
        if not takes_whole_messages(getattr(self.layer.streams.get(attempt.stream_id), "child_layer", None)):
            self.log("codex-failover: a gated WebSocket's upstream layers are not as expected; closing it",
                     logging.WARNING)
            self.close("the WebSocket layers are not as expected")

    def extensions(self, attempt: Carried, side: str) -> list | None:
        """The wsproto extensions (the list itself) an upgraded stream speaks to `side` with, or None."""
        stream = self.layer.streams.get(attempt.stream_id)
        ws = getattr(getattr(stream, "child_layer", None), f"{side}_ws", None)
        extensions = getattr(getattr(ws, "_proto", None), "extensions", None)
        return extensions if isinstance(extensions, list) else None

    async def cancel(self, attempt: Carried, message: str) -> None:
        """Stop one attempt (HTTP/2: stream reset; HTTP/1.1: connection closed); one still waiting for
        its connection never gets it (`abandoned`): not one byte of it leaves."""
        if attempt.stream_id not in self.attempts:
            return
        attempt.abandoned = not attempt.sent
        await self.server_event(_ToStream(self.client, attempt.stream_id, message))

    def abandoned(self, stream_id: int) -> bool:
        return getattr(self.attempts.get(stream_id), "abandoned", False)

    def unsent(self) -> list[Carried]:
        return [a for a in self.attempts.values() if not a.sent] if self.attempts else []

    def head_written(self, attempt: Carried) -> bool:
        """Was its head written? (The HTTP/1 client layer holds it; the HTTP/2 one mapped its stream id.)"""
        return any(getattr(c, "request", None) is attempt.flow.request or attempt.stream_id in getattr(c, "our_stream_id", ())
                   for c in self.below(*(c for c in self.layer.connections.values() if c is not self.source)))

    @staticmethod
    def below(*tops):
        """Each layer from `tops` down their `child_layer` chains (TLS, a tunnel, HttpClient, Http1/2Client)."""
        for current in tops:
            while current is not None:
                yield current
                current = getattr(current, "child_layer", None)

    def set_reading(self, on: bool) -> None:
        """Pause or resume reading the upstream socket (backpressure, attempt.py)."""
        io = self.transports.get(self.kept) if self.kept is not None else None
        transport = getattr(io.writer, "transport", None) if io is not None else None
        if transport is not None and not transport.is_closing():
            transport.resume_reading() if on else transport.pause_reading()

    async def handle_hook(self, hook: commands.StartHook) -> None:
        (data,) = hook.args()
        socket = next((s for s in self.sockets.values() if s.flow is data), None) if self.sockets else None
        if socket is not None:
            socket.hooked(hook.name, before=True)
        await ctx.master.addons.handle_lifecycle(hook)  # as mitmproxy's ProxyConnectionHandler runs it
        if isinstance(data, mitmflow.Flow):
            await data.wait_for_resume()
        if socket is not None:
            if isinstance(hook, WebsocketStartHook):
                self._whole_messages(socket)
            socket.hooked(hook.name, before=False)
        if isinstance(hook, (http_layers.HttpResponseHook, http_layers.HttpErrorHook, WebsocketEndHook)):
            if not (isinstance(hook, http_layers.HttpResponseHook) and data.websocket is not None):
                self._over(data)  # (an upgrade that was accepted goes on as its socket)
        elif isinstance(hook, server_hooks.ServerDisconnectedHook) and data.server is self.kept:
            self._gone()

    async def handle_connection(self, connection) -> None:
        try:
            await super().handle_connection(connection)
        finally:  # its cleanup, skipped when a close cancels it mid-event (in its server_event)
            io = self.transports.pop(connection, None)
            if io is not None:
                if io.writer is not None:
                    io.writer.close()
                if connection is self.kept:
                    self._gone()

    def _over(self, flow) -> None:
        for sid, attempt in list(self.attempts.items()):
            if attempt.flow is flow:
                del self.attempts[sid]
                self.sockets.pop(sid, None)
                own = self.transports.get(flow.server_conn) if flow.server_conn is not self.kept else None
                if own is not None and own.handler is not None:
                    own.handler.cancel("closed by codex-failover")  # a connection of its own (see get_connection)
                attempt.over.set()
                if self.on_over is not None:
                    self.on_over(self, attempt)

    def log(self, message: str, level: int = logging.INFO, exc_info=None) -> None:
        logging.getLogger("mitmproxy.proxy.server").log(
            replay_level(level, ctx.options.failover_verbose), f"[warm {self.key.host}] {message}", exc_info=exc_info)


def server_at(address: tuple[str, int]):
    """A server connection object for `address` (an attempt flow's, before it is sent)."""
    return Server(address=address)
