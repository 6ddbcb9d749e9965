"""A proxy client's connection inside mitmproxy's layers: the held client stream's side of
mitm/held_stream.py, and what the addon needs of the proxy servers' client connections.

`StreamWire.attach` registers one held flow's stream in the client's layers: it swaps the client's
`HttpLayer` class for `HeldHttpLayer`. The stream gets a stand-in server connection (a `Server` never
dialled, `via` `codex-failover.hop:<n>`, with a `HopLayer` behind it) only once it needs one
(`StreamWire.stand_in`): a stream attempt 1 serves on its own connection never does. From then on:
- the layers turn what happens to the stream into calls on its `Held` (the HeldStream): its request
  given away, the client leaving, a WebSocket's frames after a 101;
- a held stream asking for its connection gets its stand-in, or (attempt 1 rides the stream,
  mitm/direct.py) mitmproxy's own connection, asked again once the run chose;
- a direct stream's request head is written with the real credential (the flow shows placeholders);
  what its connection answers goes to the DirectAttempt first: held, released at a commit (whole
  events, then the rest through the committed machine; ended before a rejection after the output
  began), or dropped when the stream is handed to its stand-in (a failover);
- the HeldStream drives the stream through its wire: the answer's events delivered by the stand-in's
  layer, the direct attempt's turns (decide, release, cancel: routed by the client connection's turn key,
  `_turn_key`), the head and first output joined in one write, the HTTP/2 buffer's backpressure.
Of the proxy servers' client connections (the end of this module): whether a client is one of theirs,
closing one as mitmproxy's inactivity timeout closes one, bounding a passed-through WebSocket's messages
in the layer mitmproxy runs it with, and the hosts they listen on. One walk of a connection's layers
(`_children`) finds a held flow's stream and a passed-through flow's WebSocket layer alike.
This module and warm_conn.py (the connections the addon makes itself) are the only ones that touch
mitmproxy's proxy core (docs/architecture.md#the-seam; the facts relied on:
docs/mitmproxy-12.3.1-replay-notes.md §10, §15).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import Http2Server, HttpLayer, HttpStream
from mitmproxy.proxy.layers.websocket import WebsocketLayer, WebsocketMessageHook
from mitmproxy.proxy.mode_specs import ProxyMode

from ..core.after_output import cut_off
from . import quiet_log
from .attempt import Capture, copy_request
from .warm_conn import WholeMessage, takes_whole_messages

_SEARCH_LIMIT = 256  # layers looked at to find a flow's stream (a client connection has a handful)
UNCLAIMED: Any = object()  # a held stream whose answer ended before the stream asked for its connection
UNCLAIMED_ERROR = "codex-failover: this held request was stopped before it reached its answer"
HOP_HOST = "codex-failover.hop"  # the stand-in's `via`: never dialled, never resolved
# An HTTP/2 client's stream that does not open its flow-control window makes mitmproxy buffer what it
# is handed (BufferedH2Connection.stream_buffers), not its socket: past H2_HIGH buffered, nothing more
# is handed over until it is under H2_LOW (and the attempt, queueing, pauses its upstream).
H2_HIGH, H2_LOW, H2_POLL = 1024 * 1024, 256 * 1024, 0.02
SERVER_LOG = logging.getLogger(quiet_log.CONNECTION_LOGGERS[0])  # where a connection handler's lines go
_RESPONSE_EVENTS = (http_layers.ResponseHeaders, http_layers.ResponseData, http_layers.ResponseTrailers,
                    http_layers.ResponseEndOfMessage, http_layers.ResponseProtocolError)
_numbers = itertools.count(1)


class Held(Protocol):
    """What the layers ask and tell a held stream (mitm/held_stream.py's HeldStream)."""

    direct: Any  # attempt 1 on the stream (mitm/direct.py), once chosen
    riding: bool  # the stream's connection is attempt 1's
    gone: bool

    @property
    def ended(self) -> bool: ...
    @property
    def choosing(self) -> bool: ...
    def gets_upstream(self) -> bool: ...
    def request_taken(self) -> None: ...
    def client_left(self, why: str) -> None: ...
    def client_data(self, data: bytes) -> None: ...
    def client_message(self, content: bytes, is_text: bool) -> bool: ...
    def direct_failed(self) -> None: ...
    def released(self) -> tuple[list, bytes]: ...
    def handed(self) -> None: ...
    def first_written(self) -> None: ...


@dataclass
class _Ended:
    """What an ended held stream leaves in its wire (`StreamWire.end`): the layers find it ended and
    reach nothing of it, so a finished request is freed by reference counting, not by the collector,
    while its stand-in waits in the layers for `_sweep`."""

    ended, choosing, riding, gone, direct = True, False, False, True, None

    def gets_upstream(self) -> bool:
        return False

    def released(self) -> tuple[list, bytes]:
        return [], b""

    def client_message(self, content: bytes, is_text: bool) -> bool:
        return False

    def request_taken(self) -> None: ...
    def client_left(self, why: str) -> None: ...
    def client_data(self, data: bytes) -> None: ...
    def direct_failed(self) -> None: ...
    def handed(self) -> None: ...
    def first_written(self) -> None: ...


ENDED: Held = _Ended()


class Deliver(events.ConnectionEvent):
    """Wakes the stand-in's layer: what the wire queued goes to the stream now."""


@dataclass
class DirectTurn(events.ConnectionEvent):
    """For the client's HttpLayer, about a held stream's direct attempt: `what` is "decide" (the run
    chose: answer the stream's parked connection request), "release" (a commit) or "cancel" (the stream
    goes to its stand-in). Its connection is the layer's turn key (`_turn_key`); `stream_id` the stream's."""

    what: str = ""
    stream_id: int = 0


class StreamWire:
    """One held stream's place in the client's layers, and what its HeldStream does through them."""

    held: Held

    def __init__(self, handler, stream_id: int, routes: list[tuple[HttpLayer, layer.Layer]], via,
                 target: tuple[tuple[str, int], bool, bytes | None]):
        self.handler, self.stream_id = handler, stream_id
        self.routes = routes  # each HttpLayer above the stream with the child that leads to it, outermost first
        self.inner = routes[-1][0]  # the last: the client's, which holds the stream
        self.via = via  # mitmproxy's own way upstream (its upstream mode's proxy), for a direct attempt
        self.conn: Server | None = None  # the stand-in, once the stream needs it (`stand_in`)
        self._target = target  # what the stand-in stands in for (address, TLS, ALPN), as the hold found it
        self.queue: list = []  # the events for the stream, handed over at the next delivery
        self.waiting = None  # the stream's GetHttpConnection: parked (the run has not chosen), or asked (dialling)
        self.delivering = False  # the stand-in's layer is handing the stream what was queued
        self._joined: list[bytes] | None = None  # the head's bytes, while they wait for the first body bytes
        self._deferred: list = []  # the stream's log lines (commands.Log) while the head waits for the body
        self._first_handed = False  # the stream handed the first body bytes over (written once it returns)

    @classmethod
    def attach(cls, flow: http.HTTPFlow) -> StreamWire | None:
        """Register a stand-in for `flow` (in its request hook) in its client connection's layers; None
        when its connection is not a proxy server's or its layers are not what this module understands."""
        handler = _proxy_connections().get(flow.client_conn.id)
        if handler is None:
            return None
        stream = _find(handler.layer, lambda node: isinstance(node, HttpStream) and getattr(node, "flow", None) is flow)
        routes = _routes(stream)
        if stream is None or routes is None:
            return None
        req = flow.request
        # (an HTTP/2 client's stream only reuses an h2 connection: the stand-in speaks what the client does)
        target = ((req.host, req.port), req.scheme == "https", flow.client_conn.alpn)
        inner = routes[-1][0]
        if not isinstance(inner, HeldHttpLayer):
            inner.__class__ = HeldHttpLayer  # (its streams and connections stay as they are)
            assert isinstance(inner, HeldHttpLayer)
            inner.held, inner.turns = {}, _turn_key(routes)
        _sweep(inner)
        wire = cls(handler, stream.stream_id, routes, flow.server_conn.via, target)
        inner.held[stream.stream_id] = wire
        return wire

    def stand_in(self) -> Server:
        """The stream's stand-in server connection (never dialled, `via` codex-failover.hop:<n>), made
        and registered in the client's layers the first time the stream needs it: when it is answered
        by the run (not by attempt 1 riding it). A stream served on its own connection never has one."""
        if self.conn is None:
            address, tls, alpn = self._target
            conn = Server(address=address, via=("http", (HOP_HOST, next(_numbers))), tls=tls, alpn=alpn,
                          timestamp_start=time.time())
            conn.state = ConnectionState.OPEN  # (after its address: an open one's is fixed)
            for http_layer, child in self.routes[:-1]:
                http_layer.connections[conn] = child
            inner = self.inner
            inner.connections[conn] = HopLayer(inner.context.fork(), self)
            self.conn = conn
        return self.conn

    def end(self, claimed: bool) -> None:
        """The answer ended. The stand-in stays registered while its stream lives (the stream may still
        send it the client's error): `_sweep` removes it at a later attach."""
        inner = self.inner
        assert isinstance(inner, HeldHttpLayer)
        held = inner.held
        if claimed or self.stream_id not in held:
            held.pop(self.stream_id, None)
        else:  # stopped before its stream asked for it (held in mitmweb's intercept, say): never a real dial
            held[self.stream_id] = UNCLAIMED
        if self.conn is not None:
            ended(self.conn)
        self.held = ENDED

    # -- the answer's events, delivered by the stand-in's layer ---------------------------------

    def head_events(self, response: http.Response, first: bytes) -> list:
        sid = self.stream_id
        return [http_layers.ResponseHeaders(sid, response, end_stream=False)] + \
            ([http_layers.ResponseData(sid, first)] if first else [])

    def data_event(self, data: bytes):
        return http_layers.ResponseData(self.stream_id, data)

    def end_event(self):
        return http_layers.ResponseEndOfMessage(self.stream_id)

    def error_event(self, message: str):
        return http_layers.ResponseProtocolError(self.stream_id, message, http_layers.ErrorCode.GENERIC_SERVER_ERROR)

    async def deliver(self, gone: Callable[[], bool]) -> None:
        """What is queued goes to the stream; then the client's socket drains (a slow client slows the
        attempt, never the proxy), and an HTTP/2 stream's buffer stays bounded."""
        await self.handler.server_event(Deliver(self.stand_in()))
        io = self.handler.transports.get(self.handler.client)
        if io is not None and io.writer is not None:
            await io.writer.drain()
        if self.h2_over():
            await self.h2_drained(gone)

    async def turn(self, what: str) -> None:
        inner = self.inner
        assert isinstance(inner, HeldHttpLayer)
        await self.handler.server_event(DirectTurn(inner.turns, what, self.stream_id))

    # -- head and first output in one write (one TLS record: docs/architecture.md#the-held-stream) --------

    def join_first(self) -> None:
        self._joined = []

    def body_started(self) -> None:
        """The stream is handing the first body bytes over: `written` once the layers return (every way
        a held stream is handed its answer ends in `written`: `HeldHttpLayer._pass`, a delivery; at the
        latest, the stream's end)."""
        self._first_handed = True

    def written(self, final: bool = False) -> None:
        """What the stream handed over is written: the client has head and first output now."""
        if final:
            self._first_handed = True
        if not self._first_handed:
            return
        self.held.first_written()
        deferred, self._deferred = self._deferred, []
        for command in deferred:  # (mitmproxy's ConnectionHandler.log, to its server logger)
            if quiet_log.would_log(SERVER_LOG, command.level, command.message):
                self.handler.log(command.message, command.level)

    def keep_back(self, command: commands.Command) -> bool:
        """Keep `command` back while the head waits for the body: bytes for the client (joined), and log
        lines (mitmproxy's "Streaming response from ..."), logged once the first output is written."""
        if self._joined is not None and isinstance(command, commands.Log):
            self._deferred.append(command)
        elif self._joined is not None and isinstance(command, commands.SendData) and command.connection is self.handler.client:
            self._joined.append(command.data)
        else:
            return False
        return True

    def flush(self, final: bool) -> layer.CommandGenerator[None]:
        """The joined bytes, in one write: once the first body bytes are in (or `final`)."""
        if self._joined and (final or self._first_handed):
            joined, self._joined = self._joined, None
            yield commands.SendData(self.handler.client, b"".join(joined))

    # -- what the layers know of the client and the upstream -----------------------------------

    def set_reading(self, server, on: bool) -> None:
        """Pause or resume reading the socket of `server`, one of the client's upstream connections."""
        io = self.handler.transports.get(server)
        transport = getattr(getattr(io, "writer", None), "transport", None)
        if transport is not None and not transport.is_closing():
            transport.resume_reading() if on else transport.pause_reading()

    def stream_reset(self) -> bool:
        """Has the client reset (or closed) its HTTP/2 stream? h2's own state, updated as the frame is
        read: seen at once, while the stream's own events still wait for a hook and reach nobody."""
        server = self.inner.connections.get(self.handler.client)
        if not isinstance(server, Http2Server):
            return False
        stream = server.h2_conn.streams.get(self.stream_id)
        if stream is None:  # h2 forgets closed streams: a reset one, or one whose id it never opened
            return self.stream_id in getattr(server.h2_conn, "_closed_streams", {self.stream_id: None})
        return bool(stream.closed)

    def h2_over(self) -> bool:
        return self._h2_buffered() > H2_HIGH

    async def h2_drained(self, stop: Callable[[], bool]) -> None:
        while self._h2_buffered() > H2_LOW and not stop():
            await asyncio.sleep(H2_POLL)

    def _h2_buffered(self) -> int:
        """Bytes of this stream that mitmproxy's HTTP/2 layer holds for the client's window."""
        server = self.inner.connections.get(self.handler.client)
        if not isinstance(server, Http2Server):
            return 0
        return sum(len(item.data) for item in server.h2_conn.stream_buffers.get(self.stream_id, ()))

    def ws_started(self) -> bool:
        """At the client flow's `websocket_start` after a 101: its WebSocket layer takes the gate's
        messages whole (each framed once toward Codex), and its inside side (toward the stand-in, which
        sees only control frames now) speaks uncompressed, as the gate's end does (ws/client_pipe.py).
        False: the layers are not as pinned."""
        stream = self.inner.streams.get(self.stream_id)
        child = getattr(stream, "child_layer", None)
        proto = getattr(getattr(child, "server_ws", None), "_proto", None)
        extensions = getattr(proto, "extensions", None)
        if not isinstance(extensions, list) or not takes_whole_messages(child):
            return False
        extensions.clear()
        return True

    async def send_message(self, content: bytes, is_text: bool) -> None:
        """A whole message of the gate's for Codex: into the client flow's WebSocket layer, which runs its
        hooks and frames it once toward the client; then the client's socket drains."""
        stream = self.inner.streams.get(self.stream_id)
        if stream is None or self.handler.transports.get(self.handler.client) is None:
            return  # the client's stream or connection is gone
        await self.handler.server_event(WholeMessage.of(stream.flow, content, is_text, from_client=False))
        io = self.handler.transports.get(self.handler.client)
        if io is not None and io.writer is not None:
            await io.writer.drain()


def _take_client_message(held: Held, flow: http.HTTPFlow) -> None:
    """After every addon saw a message of a gated client flow: Codex's goes to the gate whole and no
    further (the layer would frame it again toward the stand-in)."""
    message = flow.websocket.messages[-1] if flow.websocket is not None and flow.websocket.messages else None
    if message is not None and message.from_client and not message.dropped \
            and held.client_message(message.content, message.is_text):
        message.drop()


def ended(conn: Server) -> None:
    """The stand-in is done: closed, and without its `via`, so the flow as saved (`-w` writes it in the
    `response` or `error` hook) or replayed goes to its URL like any other."""
    if conn.via is not None and conn.via[1][0] == HOP_HOST:
        conn.state = ConnectionState.CLOSED
        conn.timestamp_end = time.time()
        conn.via = None


def relay_server(port: int) -> Server:
    """The server connection that sends a flow to the loopback relay (the hop's fallback)."""
    return Server(address=("127.0.0.1", port))


class HopLayer(layer.Layer):
    """The stand-in server connection's layer: swallows the request, produces the answer."""

    def __init__(self, context, wire: StreamWire):
        super().__init__(context)
        self.wire = wire

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        held = self.wire.held
        if isinstance(event, http_layers.RequestEndOfMessage):
            held.request_taken()
        elif isinstance(event, http_layers.RequestProtocolError):  # the client left or reset its stream
            held.client_left(event.message)
        elif held.ended:
            pass  # the answer ended: whatever the stream still sends is dropped
        elif isinstance(event, Deliver):
            queue = self.wire.queue
            while queue:
                yield http_layers.ReceiveHttp(queue.pop(0))
        elif isinstance(event, http_layers.RequestData):
            held.client_data(event.data)  # after a 101: the client's frames, from mitmproxy's WebSocket layer


class HeldHttpLayer(HttpLayer):
    """The client's HttpLayer (its class swapped in `attach`): a held stream gets its stand-in whatever
    its URL is by then (another addon's request hook, map_remote say, may change it after ours); every
    other stream gets a connection as mitmproxy would give it. A stream whose first attempt rides it
    gets its connection as mitmproxy gives it, and what that connection answers goes to its
    DirectAttempt first."""

    held: dict[int, StreamWire | object]  # stream id -> its held stream's wire (or UNCLAIMED)
    turns: Server  # the key the held streams' turns are routed to this layer by (`_turn_key`)
    _batch: dict | None = None  # while an upstream connection's event is handled: released data, by stream

    def _wire(self, stream_id: int) -> StreamWire | None:
        wire = self.held.get(stream_id)
        return wire if isinstance(wire, StreamWire) else None

    def get_connection(self, event, *, reuse: bool = True) -> layer.CommandGenerator[None]:
        stream = self.command_sources.get(event)
        held = self.held.get(stream.stream_id) if isinstance(stream, HttpStream) else None
        if held is None or not isinstance(stream, HttpStream):
            yield from super().get_connection(event, reuse=reuse)
            return
        wire = self._wire(stream.stream_id)
        if wire is not None and wire.held.choosing:  # the run has not chosen: asked again then
            wire.waiting = event
            return
        if wire is not None and wire.held.gets_upstream():
            event.via = wire.via  # (the way another addon's request hook left the flow's is not the stream's)
            wire.waiting = event  # until it is answered (a dial that hangs: the cancel answers it)
            yield from super().get_connection(event, reuse=reuse)  # attempt 1 rides the stream
            return
        del self.command_sources[event]
        reply: tuple[Server | None, str | None]
        if wire is None:  # UNCLAIMED: mitmproxy answers the client 502 with this
            del self.held[stream.stream_id]
            reply = (None, UNCLAIMED_ERROR)
        else:
            reply = (wire.stand_in(), None)
        yield from self.event_to_child(stream, http_layers.GetHttpConnectionCompleted(event, reply))

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """An injected WebSocket message for a held flow goes to its stream (mitmproxy would look for an
        HTTP/1 client layer behind the stand-in); a direct attempt's turns are taken here."""
        if isinstance(event, DirectTurn) and event.connection is self.turns:
            wire = self._wire(event.stream_id)
            if wire is not None:
                yield from self._turn(wire, event.what)
            return  # (another HttpLayer's turn, one in a tunnel below: routed on by its key, as any connection's)
        hop_layer = self.connections.get(event.flow.server_conn) if isinstance(event, events.MessageInjected) else None
        if isinstance(hop_layer, HopLayer) and hop_layer.wire.stream_id in self.streams:
            yield from self.event_to_child(self.streams[hop_layer.wire.stream_id], event)
        else:
            yield from super()._handle_event(event)

    def _turn(self, wire: StreamWire, what: str) -> layer.CommandGenerator[None]:
        """The run's turn for a direct stream: it chose, it committed, or it stopped the attempt."""
        if what == "release":
            yield from self._release(wire)
        elif what == "cancel":
            yield from self._cancel(wire)
        elif wire.waiting is not None and wire.held.choosing is False:  # "decide": answered as chosen
            parked, wire.waiting = wire.waiting, None
            if parked in self.command_sources:
                yield from self.get_connection(parked)

    def _release(self, wire: StreamWire) -> layer.CommandGenerator[None]:
        held = wire.held
        stream, direct = self.streams.get(wire.stream_id), held.direct
        if stream is None or direct is None:
            return
        kept, body = held.released()
        sid = wire.stream_id
        heads = [event for event in kept if isinstance(event, http_layers.ResponseHeaders)]
        ends = [event for event in kept if not isinstance(event, (http_layers.ResponseHeaders, http_layers.ResponseData))]
        released = heads + ([http_layers.ResponseData(sid, body)] if body else [])
        released += [] if direct.cutting else ends
        if body:
            wire.join_first()  # head and first output in one write
        for event in released:
            if isinstance(event, http_layers.ResponseHeaders):  # first output: the stream's bookkeeping
                event.response.stream = Capture(on_first=wire.body_started)
            yield from self._pass(stream, wire, event)
        yield from self._cut(stream, wire)

    def _reset_upstream(self, wire: StreamWire) -> layer.CommandGenerator[None]:
        """The direct stream's upstream stream is reset (HTTP/1.1: its connection closed): nothing more of
        that answer is wanted."""
        direct = wire.held.direct
        conn_layer = self.connections.get(direct.server) if direct is not None and direct.server is not None else None
        if conn_layer is not None and not direct.finished:
            error = http_layers.RequestProtocolError(wire.stream_id, "attempt cancelled by codex-failover",
                                                     http_layers.ErrorCode.CANCEL)
            yield from HttpLayer.event_to_child(self, conn_layer, error)

    def _cancel(self, wire: StreamWire) -> layer.CommandGenerator[None]:
        """From now on the stream's answer is its stand-in's: the connection request it is still to make,
        or is waiting on (a dial under way or hanging), gets the stand-in; a request that left is reset."""
        held = wire.held
        direct, stream = held.direct, self.streams.get(wire.stream_id)
        if direct is None or direct.server is None:
            held.direct_failed()
            waiting, wire.waiting = wire.waiting, None
            for queued in self.waiting_for_establishment.values():
                if waiting is not None and waiting in queued:
                    queued.remove(waiting)
            source = self.command_sources.pop(waiting, None) if waiting is not None else None
            if source is not None:
                yield from self.event_to_child(source, http_layers.GetHttpConnectionCompleted(waiting, (wire.stand_in(), None)))
            return
        if stream is not None:
            stream.context.server = stream.flow.server_conn = wire.stand_in()
            held.request_taken()
        yield from self._reset_upstream(wire)

    def event_to_child(self, child, event: events.Event) -> layer.CommandGenerator[None]:
        """A held stream's commands, with its head's bytes and log lines held while its head waits for
        the first body bytes; the moment the layers return, what it wrote is sent (`StreamWire.written`).
        A delivery (the stand-in's layer handing the stream what was queued) ends with whatever is still
        joined. A direct attempt's head goes to its connection with the real credential; what comes back
        goes to the attempt first."""
        if isinstance(child, HopLayer):
            wire = child.wire
            wire.delivering = True
            try:
                yield from super().event_to_child(child, event)
            finally:
                wire.delivering = False
            yield from wire.flush(final=True)
            wire.written()
            return
        if not isinstance(child, HttpStream):
            upstream = self._wire(event.stream_id) if isinstance(event, (http_layers.RequestHeaders,
                                                                         http_layers.RequestProtocolError)) else None
            if upstream is not None and upstream.held.direct is not None and upstream.held.riding:
                yield from self._to_upstream(upstream, child, event)
            else:
                yield from self._from_connection(child, event)
            return
        found = self.held.get(child.stream_id)
        if not isinstance(found, StreamWire):
            yield from super().event_to_child(child, event)
            return
        wire, held = found, found.held
        if isinstance(event, events.HookCompleted) and isinstance(event.command, WebsocketMessageHook):
            _take_client_message(held, event.command.flow)
        direct = held.direct
        if isinstance(event, http_layers.RequestProtocolError) and (held.choosing or wire.waiting is not None):
            # The stream waits for its connection (paused: it would queue this until then): the run stops now.
            (direct or held).client_left(event.message)
        if direct is not None and held.riding and not wire.delivering:
            if isinstance(event, http_layers.GetHttpConnectionCompleted):
                event = self._connected(wire, event)
            elif isinstance(event, _RESPONSE_EVENTS):
                batch = self._batch
                if isinstance(event, http_layers.ResponseData) and batch is not None:
                    batch.setdefault(child.stream_id, (child, wire, bytearray()))[2].extend(event.data)
                    return  # joined with the rest of this read (`_from_connection`)
                if batch:
                    yield from self._joined_data(batch.pop(child.stream_id, None))
                yield from self._released(child, wire, _take(direct, event))
                return
        yield from self._pass(child, wire, event)

    def _released(self, stream, wire: StreamWire, passing: list) -> layer.CommandGenerator[None]:
        """What a direct stream gets of its upstream's event (nothing while held); at a cut (a rejection
        after the output began) its end, and its upstream's reset."""
        for event in passing:
            yield from self._pass(stream, wire, event)
        yield from self._cut(stream, wire)

    def _cut(self, stream, wire: StreamWire) -> layer.CommandGenerator[None]:
        """A released stream whose machine saw a rejection after the output began: it ends here for its
        client (`_cut_end`), and its upstream stream is reset."""
        direct = wire.held.direct
        if direct is None or not direct.cutting:
            return
        direct.cut_ended()
        for event in _cut_end(direct, wire.stream_id):
            yield from self._pass(stream, wire, event)
        yield from self._reset_upstream(wire)

    def _joined_data(self, pending) -> layer.CommandGenerator[None]:
        """A read's data for a direct stream, as one event: to its attempt, and (released) on to the stream."""
        if pending is None:
            return
        stream, wire, data = pending
        direct = wire.held.direct
        if direct is None:
            return
        passing = _take(direct, http_layers.ResponseData(wire.stream_id, bytes(data)))
        if self.streams.get(wire.stream_id) is stream:
            yield from self._released(stream, wire, passing)

    def _from_connection(self, child, event: events.Event) -> layer.CommandGenerator[None]:
        """An upstream connection's event: the data it brings a direct stream is one chunk, for its attempt
        (one item for the run) and, released, for the stream (mitmproxy hands a stream each HTTP chunk of
        a read on its own: a write to the client and a pass through its layers each)."""
        outer = self._batch
        if outer is not None:  # (within another connection's event: that one sends it)
            yield from super().event_to_child(child, event)
            return
        self._batch = {}
        try:
            yield from super().event_to_child(child, event)
            batch = self._batch
        finally:
            self._batch = None
        for pending in batch.values():
            yield from self._joined_data(pending)

    def _pass(self, child, wire: StreamWire, event: events.Event) -> layer.CommandGenerator[None]:
        for command in super().event_to_child(child, event):
            if wire.keep_back(command):
                yield from wire.flush(final=False)
                continue
            yield from wire.flush(final=True)  # anything else keeps its place after the head
            yield command  # executed (written) before the loop goes on
        yield from wire.flush(final=not wire.delivering)
        wire.written()
        if wire.held.direct is not None and isinstance(event, http_layers.ResponseData) and not wire.delivering:
            wire.held.handed()

    def _connected(self, wire: StreamWire, event):
        """The direct stream's connection: the attempt's, or (it failed, or the attempt was stopped
        meanwhile) the stand-in, which then takes the request and answers what the run decides."""
        direct = wire.held.direct
        wire.waiting = None
        conn, err = event.reply
        if err is None and direct.holding:
            direct.server = conn
            return event
        if err is not None:
            direct.connect_failed(err)
        wire.held.direct_failed()
        return http_layers.GetHttpConnectionCompleted(event.command, (wire.stand_in(), None))

    def _to_upstream(self, wire: StreamWire, child, event) -> layer.CommandGenerator[None]:
        """A direct stream's request head, with the real secrets for the moment its layers write it; a
        client that reset the stream ends the run."""
        direct = wire.held.direct
        if isinstance(event, http_layers.RequestProtocolError):
            direct.client_left(event.message)
            yield from super().event_to_child(child, event)
            return
        request = event.request
        # The wire's own copy of the request, with the real values: mitmproxy's HTTP/2 layer may write a
        # head it queued (the upstream's stream limit) later, from the event; the flow keeps placeholders.
        copy = copy_request(request)
        copy.headers = direct.wire_head(request.headers)
        yield from super().event_to_child(child, http_layers.RequestHeaders(event.stream_id, copy, event.end_stream))
        stream = self.streams.get(wire.stream_id)
        direct.head_sent(request, stream.context.server if stream is not None else direct.server)
        wire.held.request_taken()


def _take(direct, event) -> list:
    """A response event from a direct stream's upstream, told to its DirectAttempt: what the stream gets
    now (released: whole events; an end after the last bytes), nothing while it is held or dropped."""
    if not direct.takes_events:
        return []
    holding = direct.holding
    if holding and not direct.keep(event, len(event.data) if isinstance(event, http_layers.ResponseData) else 0):
        return []  # past failover_max_body: dropped
    if isinstance(event, http_layers.ResponseHeaders):
        direct.on_head(event.response, event.end_stream)
    elif isinstance(event, http_layers.ResponseData):
        out = direct.on_data(event.data)
        return [http_layers.ResponseData(event.stream_id, out)] if out else []
    elif isinstance(event, http_layers.ResponseEndOfMessage):
        out = direct.on_end()
        last = [http_layers.ResponseData(event.stream_id, out)] if out else []
        return last + [event] if direct.passing else last  # (cutting: `_cut` ends it)
    elif isinstance(event, http_layers.ResponseProtocolError):
        direct.on_broken(event.message)
    return [event] if direct.passing else []


def _cut_end(direct, stream_id: int) -> list:
    """How a stream cut before a rejection ends for its client: as a stream ends (HTTP/1.1's last chunk,
    HTTP/2's END_STREAM), without `response.completed`, which Codex re-sends; a body of a stated length
    is cut off instead (its client would wait for the rest)."""
    response = direct.flow.response
    if response is not None and cut_off(response.headers):
        return [http_layers.ResponseProtocolError(stream_id, "codex-failover: the stream ends before a rejection "
                                                  "after its output began", http_layers.ErrorCode.CANCEL)]
    return [http_layers.ResponseEndOfMessage(stream_id)]


def _turn_key(routes: list[tuple[HttpLayer, layer.Layer]]) -> Server:
    """The key a client connection's held streams' turns (`DirectTurn`) reach its HttpLayer by: a
    connection never dialled, registered once in the HttpLayers above it (a tunnel's), so the layers
    between pass the turn on as they pass an event of a connection they do not own (a TLS layer
    stops the events of its own: the stream's upstream connection could not carry it)."""
    key = Server(address=(HOP_HOST, 0), via=("http", (HOP_HOST, 0)))
    for http_layer, child in routes[:-1]:
        http_layer.connections[key] = child
    return key


def _sweep(inner: HttpLayer) -> None:
    """Forget the stand-ins of ended answers whose streams are gone (bounded by live streams)."""
    for conn, child in list(inner.connections.items()):
        if isinstance(child, HopLayer) and child.wire.held.ended and child.wire.stream_id not in inner.streams:
            for http_layer, _ in child.wire.routes:
                http_layer.connections.pop(conn, None)
    held: dict = getattr(inner, "held", {})
    for sid in [sid for sid, conn in held.items() if conn is UNCLAIMED and sid not in inner.streams]:
        del held[sid]


def _children(node: layer.Layer):
    if isinstance(node, HttpLayer):
        yield from node.streams.values()
    for name in ("layer", "child_layer"):  # NextLayer's decision; a tunnel's or a stream's child
        child = getattr(node, name, None)
        if isinstance(child, layer.Layer):
            yield child
    owner = getattr(getattr(node, "_handle_event", None), "__self__", None)  # a mode layer hands on this way
    if isinstance(owner, layer.Layer) and owner is not node:
        yield owner


def _find(root: layer.Layer, wanted: Callable[[layer.Layer], bool]) -> Any:
    """The first layer under `root` that is `wanted` (a bounded walk), or None."""
    todo, seen = [root], 0
    while todo and seen < _SEARCH_LIMIT:
        node = todo.pop()
        seen += 1
        if wanted(node):
            return node
        todo.extend(_children(node))
    return None


def _routes(stream: HttpStream | None) -> list[tuple[HttpLayer, layer.Layer]] | None:
    """Each HttpLayer above `stream` with the child that leads to it, outermost first; the last is the
    stream's own. None when the stack is not what this module understands."""
    if stream is None:
        return None
    path = stream.context.layers
    routes = []
    for i, node in enumerate(path):
        if isinstance(node, HttpLayer):
            streams = set(map(id, node.streams.values()))
            child = next((later for later in path[i + 1:] if id(later) in streams), None)
            if child is None:
                return None
            routes.append((node, child))
    if not routes or routes[-1][1] is not stream:
        return None
    return routes


# -- the proxy servers' client connections ---------------------------------------------------

def _proxy_connections() -> dict:
    server = ctx.master.addons.get("proxyserver") if getattr(ctx, "master", None) else None
    return getattr(server, "connections", None) or {}


def is_proxy_client(client_id: str) -> bool:
    """A client connection of mitmproxy's own proxy servers (not a kept connection's stand-in client)."""
    return client_id in _proxy_connections()


def drop_client(client_id: str, why: str) -> bool:
    """Close a client connection of the proxy servers, as mitmproxy's inactivity timeout closes one
    (its handler cancelled: its hooks run, `client_disconnected` last). False when it is gone."""
    handler = _proxy_connections().get(client_id)
    io = handler.transports.get(handler.client) if handler is not None else None
    if io is None or io.handler is None or io.handler.done():
        return False
    io.handler.cancel(why)
    return True


def bound_websocket(flow: http.HTTPFlow, cap: int, over: Callable[[], None]) -> bool:
    """A passed-through WebSocket (mitmproxy's own layer between the client and the upstream): a
    message that grows past `cap` bytes while mitmproxy gathers it ends the connection, as if the
    sender had gone (wsproto answers 1006 to both sides), and `over()` is told. False when its layer
    is not found (the layers are not as pinned: it is left as mitmproxy runs it)."""
    layer = _websocket_layer(flow)
    if layer is None:
        return False
    for ws in (layer.client_ws, layer.server_ws):
        _bound_inflate(getattr(getattr(ws, "_proto", None), "extensions", None), cap, over)
        receive = ws.receive_data

        def bounded(data, ws=ws, receive=receive):
            if data is not None and sum(map(len, ws.frame_buf)) + len(data) > cap:
                ws.frame_buf = [b""]
                over()
                return receive(None)
            return receive(data)

        ws.receive_data = bounded  # type: ignore[method-assign]  # this connection's reads only: its own attribute
    return True


def _bound_inflate(extensions, cap: int, over: Callable[[], None]) -> None:
    """permessage-deflate inflating at most `cap` a message (ws/bounded_deflate.py): 64 KiB can hold 64 MiB."""
    from wsproto.extensions import PerMessageDeflate
    from wsproto.frame_protocol import CloseReason

    from ..ws.bounded_deflate import BoundedDeflate  # (ws/ is above mitm/: asked only here)

    for i, ext in enumerate(extensions if isinstance(extensions, list) else ()):
        if type(ext) is PerMessageDeflate:
            bounded = BoundedDeflate(cap)
            bounded.__dict__.update({k: v for k, v in vars(ext).items() if k not in ("max_message", "_taken")})
            inflate = bounded.frame_inbound_payload_data

            def told(proto, data, inflate=inflate):
                out = inflate(proto, data)
                if out is CloseReason.MESSAGE_TOO_BIG:
                    over()
                return out

            bounded.frame_inbound_payload_data = told  # type: ignore[method-assign]
            extensions[i] = bounded


def _websocket_layer(flow: http.HTTPFlow) -> WebsocketLayer | None:
    handler = _proxy_connections().get(flow.client_conn.id)
    if handler is None:
        return None
    return _find(handler.layer, lambda node: isinstance(node, WebsocketLayer) and node.flow is flow)


def listen_hosts(modes, listen_host: str) -> list[str]:
    """The hosts mitmproxy listens on for its `mode` specs (unparseable ones skipped), in order."""
    hosts: dict[str, None] = {}
    for spec in modes:
        with contextlib.suppress(ValueError):
            hosts[ProxyMode.parse(spec).listen_host(listen_host)] = None
    return list(hosts)
