"""The held client's hop, in process: the run's answer goes straight into the client's own layers.

mitmproxy streams to a client only what a server connection delivers. So a held flow gets a stand-in
server connection in its own `HttpLayer`: a `Server` never dialled (`via` `codex-failover.hop:<n>`),
whose layer (`HopLayer`) takes the request (the attempts carry it) and hands the flow's `HttpStream`
the answer as a server's layer would: a response, or a 101 and then a WebSocket's bytes both ways.
The client's `HttpLayer` (class swapped for `_HeldHttpLayer`) gives a held stream its stand-in
whatever its URL is by then; events reach it through the client's `ConnectionHandler.server_event`.
When the layers are not as expected, `attach` returns None and the loopback relay is used.
docs/architecture.md#the-hop; the facts relied on: docs/mitmproxy-12.3.1-replay-notes.md §10.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import types
from typing import AsyncIterator, Callable

from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, layer
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import Http2Server, HttpLayer
from mitmproxy.proxy.mode_servers import ProxyConnectionHandler

from ..net.relay import UpstreamBroken
from . import fallbacks, hook_chain
from .attempt import Capture
from .client_answers import client_response
from .direct import Mode
from .held_layer import _UNCLAIMED, HopLayer, _Deliver, _Direct, _HeldHttpLayer, _routes, _stream_of, _sweep
from .hop_state import HopState

log = logging.getLogger("codex_failover")

HOP_HOST = "codex-failover.hop"  # the stand-in's `via`: never dialled, never resolved
HOP_TAG = "codex_failover.hop"  # flow.metadata of a client flow answered in process
# An HTTP/2 client's stream that does not open its flow-control window makes mitmproxy buffer what it
# is handed (BufferedH2Connection.stream_buffers), not its socket: past H2_HIGH buffered, the hop
# hands over nothing more until it is under H2_LOW (and the attempt, queueing, pauses its upstream).
H2_HIGH, H2_LOW, H2_POLL = 1024 * 1024, 256 * 1024, 0.02
HOP_HOLDS = fallbacks.seam_holds("hop")
_numbers = itertools.count(1)
_streaming: set["ClientHop"] = set()  # answers being streamed right now (the status page counts them)
_by_flow: dict[str, "ClientHop"] = {}  # client flow id -> its hop, until the answer ended


def streaming() -> int:
    return len(_streaming)


class ClientHop(HopState):
    """One held client flow's stand-in server connection; answered once, like a RelaySession."""

    def __init__(self, handler, conn: Server, stream_id: int, layers: list[HttpLayer], abort: Callable[[], object]):
        super().__init__(handler, stream_id, abort)
        self.conn = conn
        self.layers = layers  # every HttpLayer it is registered in, outermost first; the last is the client's own
        self._joined: list[bytes] | None = None  # the head's bytes, while they wait for the first body bytes
        # The direct attempt (direct.py): None while the run may still choose it (`may_go_direct`),
        # True once attempt 1 rides the stream, False for the stand-in.
        self.choice: bool | None = False
        self.direct = None  # its DirectAttempt
        self.parked = None  # the stream's GetHttpConnection, while the run has not chosen
        self.asked = None  # a direct stream's GetHttpConnection, while mitmproxy dials for it
        self.via = None  # the flow's server connection's `via` before the stand-in took its place
        self.held_bytes = b""  # a committed direct attempt's held output, for its stream

    # -- setup ------------------------------------------------------------------------------

    @classmethod
    def attach(cls, flow: http.HTTPFlow, abort: Callable[[], object]) -> "ClientHop | None":
        """Put a stand-in server connection in the client's layers for `flow` (in its request
        hook); None when that cannot be done here (the loopback relay is used instead)."""
        if not HOP_HOLDS:
            return None
        try:
            handler = ctx.master.addons.get("proxyserver").connections[flow.client_conn.id]
        except (AttributeError, KeyError):
            return None
        stream = _stream_of(handler.layer, flow)
        routes = _routes(stream)
        if routes is None:
            return None
        req = flow.request
        conn = Server(address=(req.host, req.port), via=("http", (HOP_HOST, next(_numbers))))
        conn.tls = req.scheme == "https"
        conn.alpn = flow.client_conn.alpn  # an HTTP/2 client's stream only reuses an h2 connection
        conn.timestamp_start = time.time()
        conn.state = ConnectionState.OPEN
        hop = cls(handler, conn, stream.stream_id, [h for h, _ in routes], abort)
        hop.via = flow.server_conn.via  # mitmproxy's own way upstream (its upstream mode's proxy), for a direct attempt
        for http_layer, child in routes[:-1]:
            http_layer.connections[conn] = child
        inner = routes[-1][0]
        _sweep(inner)
        inner.connections[conn] = HopLayer(inner.context.fork(), hop)
        if not isinstance(inner, _HeldHttpLayer):
            inner.__class__, inner.held = _HeldHttpLayer, {}
        inner.held[stream.stream_id] = conn
        flow.server_conn = conn
        flow.metadata[HOP_TAG] = True
        _by_flow[flow.id] = hop
        hop.flow_id = flow.id
        if type(handler).handle_hook is ProxyConnectionHandler.handle_hook:  # its hooks at a lower CPU cost
            handler.handle_hook = types.MethodType(hook_chain.client_handle_hook, handler)
        return hop

    def detach(self) -> None:
        """The answer ended. The stand-in stays registered while its stream lives (the stream may
        still send it the client's error): `_sweep` removes it at a later attach."""
        self._first_handed = True
        self.written()  # first_out set, held log lines logged: whatever the answer was
        _streaming.discard(self)
        _by_flow.pop(self.flow_id, None)
        held = self.layers[-1].held
        if self.claimed or self.stream_id not in held:
            held.pop(self.stream_id, None)
        else:  # stopped before its stream asked for it (held in mitmweb's intercept, say): never a real dial
            held[self.stream_id] = _UNCLAIMED
        self.detached = True
        ended(self.conn)

    # -- the direct attempt (direct.py) -------------------------------------------------------

    def may_go_direct(self) -> None:
        """In the request hook: the stream's connection waits for the run's first attempt (`decide`)."""
        self.choice = None

    def decide(self, direct: bool) -> None:
        """The run's first attempt chose (once): ride the stream, or wait for the hop's answer."""
        if self.choice is not None:
            return
        self.choice = direct
        if self.parked is not None:
            self._tell("decide")

    def release(self, attempt, live_feed, held: bytes) -> None:
        """Commit the direct attempt: the stream gets the whole events held (`held`), then its
        upstream's rest through `live_feed`."""
        self.status = 200 if attempt.flow.response is None else attempt.flow.response.status_code
        attempt.live_feed, self.held_bytes = live_feed, held
        self.pump = asyncio.get_running_loop().create_task(self._event("release"))

    def set_reading(self, server, on: bool) -> None:
        """Pause or resume reading the socket of `server`, one of the client's upstream connections
        (the direct attempt's backpressure)."""
        io = self.handler.transports.get(server)
        transport = getattr(getattr(io, "writer", None), "transport", None)
        if transport is not None and not transport.is_closing():
            transport.resume_reading() if on else transport.pause_reading()

    def direct_handed(self) -> None:
        """A released direct stream was handed data: an HTTP/2 client whose window stays shut makes
        mitmproxy buffer it, so past H2_HIGH the upstream is not read until that is under H2_LOW."""
        direct = self.direct
        if direct is not None and self._h2_buffered() > H2_HIGH:
            # Again at each read: asyncio's StreamReader resumes a transport it had paused itself.
            watching = direct._paused
            direct._set_reading(False, shared_too=True)
            if not watching:
                self._tell_later(self._unpause_direct())

    async def _unpause_direct(self) -> None:
        while self._h2_buffered() > H2_LOW and not self.gone and not self.detached:
            await asyncio.sleep(H2_POLL)
        if self.direct is not None:
            self.direct._set_reading(True)

    def _tell_later(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def cancel_direct(self) -> None:
        await self._event("cancel")

    def _tell(self, what: str) -> None:
        self._tell_later(self._event(what))

    async def _event(self, what: str) -> None:
        if not self.gone:
            with contextlib.suppress(ConnectionError):
                await self.handler.server_event(_Direct(self.conn, what))

    # -- the answer (RelaySession's interface) ------------------------------------------------

    def answer(self, status: int, reason: str, headers: list[tuple[bytes, bytes]],
               body: Callable[[], AsyncIterator[bytes]], first: bytes = b"") -> None:
        """The head and `first` go to the client together; then `body`, chunk by chunk."""
        self.decide(False)  # answered before any attempt rode the stream (no pool credential, say)
        self.status, self.reason, self.headers, self.body, self.first = status, reason, headers, body, first
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    # -- a 101 (the WebSocket gate), then bytes both ways through the client's WebSocket layer --

    def upgrade(self, headers: list[tuple[bytes, bytes]], on_data: Callable[[bytes], object]) -> None:
        """Answer 101; the frames mitmproxy's WebSocket layer sends on toward the server go to
        `on_data` (b"": the client is gone), and `write` hands it the server side's, in order."""
        self.decide(False)  # (a held upgrade is never a direct attempt's)
        self.status, self.on_data, sid = 101, on_data, self.stream_id
        response = http.Response(b"HTTP/1.1", 101, b"Switching Protocols", http.Headers(headers), b"", None, time.time(), None)
        self._hand(http_layers.ResponseHeaders(sid, response), http_layers.ResponseEndOfMessage(sid))

    def write(self, data: bytes) -> None:  # b"": the server side closed
        sid = self.stream_id
        self._hand(http_layers.ResponseData(sid, data) if data else http_layers.ResponseEndOfMessage(sid))

    def _hand(self, *events_: http_layers.HttpEvent) -> None:
        if not (self.gone or self.detached):
            self.queue += events_
            if self.pump is None or self.pump.done():
                self.pump = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            if await self._claimed():
                while self.queue and not self.gone and not self.detached:
                    await self._deliver()
        except ConnectionError:
            self._stop()

    async def _pump(self) -> None:
        try:
            if await self._claimed():
                _streaming.add(self)
                await self._stream()
        except UpstreamBroken as exc:  # the client sees the stream cut, as it would have directly
            error = http_layers.ResponseProtocolError(self.stream_id, f"upstream broke: {exc}",
                                                      http_layers.ErrorCode.GENERIC_SERVER_ERROR)
            with contextlib.suppress(ConnectionError):  # the client left meanwhile
                await self._deliver(error)
        except ConnectionError:
            self._stop()
        finally:
            self.detach()

    async def _stream(self) -> None:
        sid = self.stream_id
        head = http_layers.ResponseHeaders(sid, self._response(), end_stream=False)
        await self._deliver(head, *([http_layers.ResponseData(sid, self.first)] if self.first else []))
        async for chunk in self.body():
            if chunk:
                await self._deliver(http_layers.ResponseData(sid, chunk))
        await self._deliver(http_layers.ResponseEndOfMessage(sid))

    def _response(self) -> http.Response:
        response = client_response(self.status, self.reason, self.headers)
        response.stream = Capture(on_first=self._body_started)  # RelayHops keeps it for mitmweb
        self._joined = [] if self.first else None
        return response

    def keep_back(self, command: commands.Command) -> bool:
        """Keep `command` back while the head waits for the body (head and first output leave in one
        write, one TLS record: docs/architecture.md#the-hop): bytes for the client (joined), and log
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

    async def _deliver(self, *events_: http_layers.HttpEvent) -> None:
        if self.gone:
            raise ConnectionError("the client left")
        self.queue.extend(events_)
        await self.handler.server_event(_Deliver(self.conn))
        io = self.handler.transports.get(self.handler.client)
        if io is not None and io.writer is not None:
            await io.writer.drain()  # backpressure: a slow client slows the attempt, never the proxy
        if self._h2_buffered() > H2_HIGH:
            while self._h2_buffered() > H2_LOW and not self.gone:
                await asyncio.sleep(H2_POLL)

    def stream_reset(self) -> bool:
        """Has the client reset (or closed) its HTTP/2 stream? h2's own state, updated as the frame is
        read: seen at once, while the stream's own events still wait for a hook (the request hook, a
        parked connection request) and reach nobody."""
        server = self.layers[-1].connections.get(self.handler.client)
        if not isinstance(server, Http2Server):
            return False
        stream = server.h2_conn.streams.get(self.stream_id)
        if stream is None:  # h2 forgets closed streams: a reset one, or one whose id it never opened
            return self.stream_id in getattr(server.h2_conn, "_closed_streams", {self.stream_id: None})
        return bool(stream.closed)

    def _h2_buffered(self) -> int:
        """Bytes of this stream that mitmproxy's HTTP/2 layer holds for the client's window."""
        server = self.layers[-1].connections.get(self.handler.client)
        if not isinstance(server, Http2Server):
            return 0
        return sum(len(item.data) for item in server.h2_conn.stream_buffers.get(self.stream_id, ()))


def ended(conn: Server) -> None:
    """The stand-in is done: closed, and without its `via`, so the flow as saved (`-w` writes it in
    the `response` or `error` hook) or replayed goes to its URL like any other."""
    if conn.via is not None and conn.via[1][0] == HOP_HOST:
        conn.state = ConnectionState.CLOSED
        conn.timestamp_end = time.time()
        conn.via = None


def ws_started(flow: http.HTTPFlow) -> None:
    """The client flow's `websocket_start` after a hop's 101: the inside side of its WebSocket layer
    (toward the stand-in) speaks uncompressed, as the gate's end does (ws/client_pipe.py)."""
    hop = _by_flow.get(flow.id)
    if hop is None or hop.on_data is None:
        return
    stream = hop.layers[-1].streams.get(hop.stream_id)
    proto = getattr(getattr(getattr(stream, "child_layer", None), "server_ws", None), "_proto", None)
    if isinstance(getattr(proto, "extensions", None), list):
        proto.extensions.clear()
    else:  # the layers are not as pinned: the inside cannot be read, so the session ends at once
        log.warning("codex-failover: a gated WebSocket's layers are not as expected; closing it")
        hop.client_left("layers not as expected")


def direct_ended(flow: http.HTTPFlow) -> None:
    """The client flow's `response` or `error` hook: a released direct attempt's hop is done."""
    hop = _by_flow.get(flow.id)
    if hop is not None and hop.direct is not None and hop.direct.mode in (Mode.RELEASED, Mode.CUTTING, Mode.CUT):
        if not hop.direct.ended.is_set():  # the stream ended without its upstream's end (the client left)
            hop.direct.client_left(flow.error.msg if flow.error else "the stream ended")
        hop.detach()


def flow_ended_unclaimed(flow: http.HTTPFlow) -> None:
    """The client flow's `error` or `response` hook: a client that left before its stream handed the
    request to the stand-in (an HTTP/2 reset while the request hook still ran), or a flow another addon
    killed or answered, is seen here, not there."""
    hop = _by_flow.get(flow.id)
    if hop is not None and not hop.claimed:
        hop.client_left(flow.error.msg if flow.error else "client error")


def relay_server(port: int) -> Server:
    """The server connection that sends a flow to the loopback relay (the hop's fallback)."""
    return Server(address=("127.0.0.1", port))



