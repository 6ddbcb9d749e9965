"""The held client's own HttpLayer and the stand-in's layer: the part of the hop (client_hop.py) that
lives inside mitmproxy's layers, with a direct attempt's (direct.py) way through them.

`attach` (client_hop.py) swaps the client's `HttpLayer` class for `_HeldHttpLayer` and registers a
`HopLayer` for the held stream's stand-in server connection. Here:
- a held stream asking for its connection gets its stand-in, or (a direct attempt: the run chose to
  let attempt 1 ride the stream) mitmproxy's own connection, asked again once the run chose;
- a direct stream's request head is written with the real credential (the flow shows placeholders);
- what that connection answers the stream goes to the DirectAttempt first: held, released in one go
  at a commit, or dropped when the stream is handed to its stand-in (a failover); the data of one
  read from an upstream connection reaches a released stream as one chunk.
docs/architecture.md#the-hop; the facts relied on: docs/mitmproxy-12.3.1-replay-notes.md §10, §15.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mitmproxy import http
from mitmproxy.connection import Server
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream

from .attempt import Capture, copy_request
from .direct import Mode

if TYPE_CHECKING:
    from .client_hop import ClientHop

_SEARCH_LIMIT = 256  # layers looked at to find a flow's stream (a client connection has a handful)
_UNCLAIMED = object()  # a held stream whose hop was stopped before the stream asked for its connection
UNCLAIMED_ERROR = "codex-failover: this held request was stopped before it reached its answer"
_RESPONSE_EVENTS = (http_layers.ResponseHeaders, http_layers.ResponseData, http_layers.ResponseTrailers,
                    http_layers.ResponseEndOfMessage, http_layers.ResponseProtocolError)


@dataclass
class _Deliver(events.ConnectionEvent):
    """Wakes the stand-in's layer: what the hop queued goes to the stream now."""


@dataclass
class _Direct(events.ConnectionEvent):
    """For the client's HttpLayer, about a held stream's direct attempt (direct.py): `what` is
    "decide" (the run chose: answer the stream's parked connection request), "release" (a commit)
    or "cancel" (the stream goes to its hop)."""

    what: str = ""


class HopLayer(layer.Layer):
    """The stand-in server connection's layer: swallows the request, produces the answer."""

    def __init__(self, context, hop: "ClientHop"):
        super().__init__(context)
        self.hop = hop

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        hop = self.hop
        if isinstance(event, http_layers.RequestEndOfMessage):
            hop.claimed = True
            hop.requested.set()
        elif isinstance(event, http_layers.RequestProtocolError):  # the client left or reset its stream
            hop.client_left(event.message)
        elif hop.detached:
            pass  # the answer ended: whatever the stream still sends is dropped
        elif isinstance(event, _Deliver):
            while hop.queue:
                yield http_layers.ReceiveHttp(hop.queue.pop(0))
        elif isinstance(event, http_layers.RequestData) and hop.on_data is not None:
            hop.on_data(event.data)  # after a 101: the client's frames, from mitmproxy's WebSocket layer


class _HeldHttpLayer(HttpLayer):
    """The client's HttpLayer (its class swapped in `attach`): a held stream gets its stand-in
    whatever its URL is by then (another addon's request hook, map_remote say, may change it
    after ours); every other stream gets a connection as mitmproxy would give it. A stream whose
    first attempt rides it (direct.py) gets its connection as mitmproxy gives it, and what that
    connection answers goes to its DirectAttempt first."""

    held: dict[int, Server | object]  # stream id -> its stand-in (or _UNCLAIMED)
    _batch: dict | None = None  # while an upstream connection's event is handled: released data, by stream

    def _hop(self, stream_id: int) -> "ClientHop | None":
        conn = self.held.get(stream_id)
        hop_layer = self.connections.get(conn) if isinstance(conn, Server) else None
        return hop_layer.hop if isinstance(hop_layer, HopLayer) else None

    def get_connection(self, event, *, reuse: bool = True) -> layer.CommandGenerator[None]:
        stream = self.command_sources.get(event)
        conn = self.held.get(stream.stream_id) if isinstance(stream, HttpStream) else None
        if conn is None:
            yield from super().get_connection(event, reuse=reuse)
            return
        hop = self._hop(stream.stream_id)
        if hop is not None and hop.choice is None and not hop.gone:  # the run has not chosen: asked again then
            hop.parked = event
            return
        if hop is not None and hop.choice and hop.direct is not None and hop.direct.mode is Mode.HOLDING and not hop.gone:
            event.via = hop.via  # (the flow shows the stand-in, whose `via` the stream asked with)
            hop.asked = event  # until it is answered (a dial that hangs: `_direct("cancel")` answers it)
            yield from super().get_connection(event, reuse=reuse)  # attempt 1 rides the stream
            return
        del self.command_sources[event]
        if conn is _UNCLAIMED:  # mitmproxy answers the client 502 with this
            del self.held[stream.stream_id]
            reply = (None, UNCLAIMED_ERROR)
        else:
            reply = (conn, None)
        yield from self.event_to_child(stream, http_layers.GetHttpConnectionCompleted(event, reply))

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """An injected WebSocket message for a held flow goes to its stream (mitmproxy would look for
        an HTTP/1 client layer behind the stand-in); a direct attempt's turns are taken here."""
        if isinstance(event, _Direct):
            hop_layer = self.connections.get(event.connection)
            if isinstance(hop_layer, HopLayer):
                yield from self._direct(hop_layer.hop, event.what)
            return
        hop_layer = self.connections.get(event.flow.server_conn) if isinstance(event, events.MessageInjected) else None
        if isinstance(hop_layer, HopLayer) and hop_layer.hop.stream_id in self.streams:
            yield from self.event_to_child(self.streams[hop_layer.hop.stream_id], event)
        else:
            yield from super()._handle_event(event)

    def _direct(self, hop: "ClientHop", what: str) -> layer.CommandGenerator[None]:
        """The run's turn for a direct stream: it chose, it committed, or it stopped the attempt."""
        if what == "release":
            yield from self._release(hop)
        elif what == "cancel":
            yield from self._cancel(hop)
        elif hop.parked is not None:  # "decide": the stream's connection request, answered as chosen
            parked, hop.parked = hop.parked, None
            if parked in self.command_sources:
                yield from self.get_connection(parked)

    def _release(self, hop: "ClientHop") -> layer.CommandGenerator[None]:
        stream, direct = self.streams.get(hop.stream_id), hop.direct
        if stream is None or direct is None:
            return
        kept, body = direct.release(direct.live_feed, hop.held_bytes)
        sid = hop.stream_id
        heads = [event for event in kept if isinstance(event, http_layers.ResponseHeaders)]
        ends = [event for event in kept if not isinstance(event, (http_layers.ResponseHeaders, http_layers.ResponseData))]
        released = heads + ([http_layers.ResponseData(sid, body)] if body else [])
        released += [] if direct.mode is Mode.CUTTING else ends
        if body:
            hop._joined = []  # head and first output in one write (ClientHop.keep_back)
        for event in released:
            if isinstance(event, http_layers.ResponseHeaders):  # first output: the hop's bookkeeping
                event.response.stream = Capture(on_first=hop._body_started)
            yield from self._pass(stream, hop, event)
        yield from self._cut(stream, hop)

    def _reset_upstream(self, hop: "ClientHop") -> layer.CommandGenerator[None]:
        """The direct stream's upstream stream is reset (HTTP/1.1: its connection closed): nothing
        more of that answer is wanted."""
        direct = hop.direct
        conn_layer = self.connections.get(direct.server) if direct is not None and direct.server is not None else None
        if conn_layer is not None and not direct.finished:
            error = http_layers.RequestProtocolError(hop.stream_id, "attempt cancelled by codex-failover",
                                                     http_layers.ErrorCode.CANCEL)
            yield from HttpLayer.event_to_child(self, conn_layer, error)

    def _cancel(self, hop: "ClientHop") -> layer.CommandGenerator[None]:
        """From now on the stream's answer is its stand-in's: the connection request it is still to make,
        or is waiting on (a dial under way or hanging), gets the stand-in; a request that left is reset."""
        direct, stream = hop.direct, self.streams.get(hop.stream_id)
        if direct is None or direct.server is None:
            hop.choice = False
            waiting, hop.parked, hop.asked = hop.parked or hop.asked, None, None
            for queued in self.waiting_for_establishment.values():
                if waiting in queued:
                    queued.remove(waiting)
            source = self.command_sources.pop(waiting, None) if waiting is not None else None
            if source is not None:
                yield from self.event_to_child(source, http_layers.GetHttpConnectionCompleted(waiting, (hop.conn, None)))
            return
        if stream is not None:
            stream.context.server = stream.flow.server_conn = hop.conn
            hop.claimed = True
            hop.requested.set()
        yield from self._reset_upstream(hop)

    def event_to_child(self, child, event: events.Event) -> layer.CommandGenerator[None]:
        """A held stream's commands, with its head's bytes and log lines held while its head waits
        for the first body bytes; the moment the layers return, what it wrote is sent
        (`ClientHop.written`). A delivery (the stand-in's layer handing the stream what was queued)
        ends with whatever is still joined. A direct attempt's head goes to its connection with the
        real credential; what comes back goes to the attempt first."""
        if isinstance(child, HopLayer):
            hop = child.hop
            hop.delivering = True
            try:
                yield from super().event_to_child(child, event)
            finally:
                hop.delivering = False
            yield from hop.flush(final=True)
            hop.written()
            return
        if not isinstance(child, HttpStream):
            hop = self._hop(event.stream_id) if isinstance(event, (http_layers.RequestHeaders,
                                                                   http_layers.RequestProtocolError)) else None
            if hop is not None and hop.direct is not None and hop.choice:
                yield from self._to_upstream(hop, child, event)
            else:
                yield from self._from_connection(child, event)
            return
        conn = self.held.get(child.stream_id)
        hop_layer = self.connections.get(conn) if conn is not None else None
        if not isinstance(hop_layer, HopLayer):
            yield from super().event_to_child(child, event)
            return
        hop = hop_layer.hop
        direct = hop.direct
        if isinstance(event, http_layers.RequestProtocolError) and (hop.choice is None or hop.asked is not None):
            # The stream waits for its connection (paused: it would queue this until then): the run stops now.
            (direct or hop).client_left(event.message)
        if direct is not None and hop.choice and not hop.delivering:
            if isinstance(event, http_layers.GetHttpConnectionCompleted):
                event = self._connected(hop, event)
            elif isinstance(event, _RESPONSE_EVENTS):
                batch = self._batch
                if isinstance(event, http_layers.ResponseData) and batch is not None:
                    batch.setdefault(child.stream_id, (child, hop, bytearray()))[2].extend(event.data)
                    return  # joined with the rest of this read (`_from_connection`)
                if batch:
                    yield from self._joined_data(batch.pop(child.stream_id, None))
                yield from self._released(child, hop, _take(direct, event))
                return
        yield from self._pass(child, hop, event)

    def _released(self, stream, hop: "ClientHop", passing: list) -> layer.CommandGenerator[None]:
        """What a direct stream gets of its upstream's event (nothing while held); at a cut (a rejection
        after the output began) its end, and its upstream's reset."""
        for event in passing:
            yield from self._pass(stream, hop, event)
        yield from self._cut(stream, hop)

    def _cut(self, stream, hop: "ClientHop") -> layer.CommandGenerator[None]:
        """A released stream whose machine saw a rejection after the output began (CUTTING): it ends
        here for its client (`_cut_end`), and its upstream stream is reset."""
        direct = hop.direct
        if direct is None or direct.mode is not Mode.CUTTING:
            return
        direct.mode = Mode.CUT
        for event in _cut_end(direct, hop.stream_id):
            yield from self._pass(stream, hop, event)
        yield from self._reset_upstream(hop)

    def _joined_data(self, pending) -> layer.CommandGenerator[None]:
        """A read's data for a direct stream, as one event: to its attempt, and (released) on to the stream."""
        if pending is None:
            return
        stream, hop, data = pending
        direct = hop.direct
        if direct is None:
            return
        passing = _take(direct, http_layers.ResponseData(hop.stream_id, bytes(data)))
        if self.streams.get(hop.stream_id) is stream:
            yield from self._released(stream, hop, passing)

    def _from_connection(self, child, event: events.Event) -> layer.CommandGenerator[None]:
        """An upstream connection's event: the data it brings a direct stream is one chunk, for its
        attempt (one item for the run) and, released, for the stream (mitmproxy hands a stream each
        HTTP chunk of a read on its own: a write to the client and a pass through its layers each)."""
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

    def _pass(self, child, hop: "ClientHop", event: events.Event) -> layer.CommandGenerator[None]:
        for command in super().event_to_child(child, event):
            if hop.keep_back(command):
                yield from hop.flush(final=False)
                continue
            yield from hop.flush(final=True)  # anything else keeps its place after the head
            yield command  # executed (written) before the loop goes on
        yield from hop.flush(final=not hop.delivering)
        hop.written()
        if hop.direct is not None and isinstance(event, http_layers.ResponseData) and not hop.delivering:
            hop.direct_handed()

    def _connected(self, hop: "ClientHop", event):
        """The direct stream's connection: the attempt's, or (it failed, or the attempt was stopped
        meanwhile) the stand-in, which then takes the request and answers what the run decides."""
        direct = hop.direct
        hop.asked = None
        conn, err = event.reply
        if err is None and direct.mode is Mode.HOLDING:
            direct.server = conn
            return event
        if err is not None:
            direct.connect_failed(err)
        hop.choice = False
        return http_layers.GetHttpConnectionCompleted(event.command, (hop.conn, None))

    def _to_upstream(self, hop: "ClientHop", child, event) -> layer.CommandGenerator[None]:
        """A direct stream's request head, with the real secrets for the moment its layers write it;
        a client that reset the stream ends the run (the hop's `client_left`)."""
        direct = hop.direct
        if isinstance(event, http_layers.RequestProtocolError):
            direct.client_left(event.message)
            yield from super().event_to_child(child, event)
            return
        request = event.request
        # The wire's own copy of the request, with the real values: mitmproxy's HTTP/2 layer may write a
        # head it queued (the upstream's stream limit) later, from the event; the flow keeps placeholders.
        wire = copy_request(request)
        wire.headers = direct.wire_headers(request.headers)
        yield from super().event_to_child(child, http_layers.RequestHeaders(event.stream_id, wire, event.end_stream))
        stream = self.streams.get(hop.stream_id)
        direct.head_sent(request, stream.context.server if stream is not None else direct.server)
        hop.claimed = True
        hop.requested.set()


def _take(direct, event) -> list:
    """A response event from a direct stream's upstream, told to its DirectAttempt: what the stream
    gets now (released: whole events; an end after the last bytes), nothing while it is held or dropped."""
    mode = direct.mode
    if mode is Mode.DROPPED or mode is Mode.CUTTING or mode is Mode.CUT:
        return []
    if mode is Mode.HOLDING and not direct.keep(event, len(event.data) if isinstance(event, http_layers.ResponseData) else 0):
        return []  # past failover_max_body: dropped
    if isinstance(event, http_layers.ResponseHeaders):
        direct.on_head(event.response, event.end_stream)
    elif isinstance(event, http_layers.ResponseData):
        out = direct.on_data(event.data)
        return [http_layers.ResponseData(event.stream_id, out)] if out else []
    elif isinstance(event, http_layers.ResponseEndOfMessage):
        out = direct.on_end()
        last = [http_layers.ResponseData(event.stream_id, out)] if out else []
        return last + [event] if direct.mode is Mode.RELEASED else last  # (cutting: `_cut` ends it)
    elif isinstance(event, http_layers.ResponseProtocolError):
        direct.on_error(event.message)
    return [event] if direct.mode is Mode.RELEASED else []


def _cut_end(direct, stream_id: int) -> list:
    """How a stream cut before a rejection ends for its client: as a stream ends (HTTP/1.1's last chunk,
    HTTP/2's END_STREAM), without `response.completed`, which Codex re-sends; a body of a stated
    length is cut off instead (its client would wait for the rest)."""
    response = direct.flow.response
    if response is not None and "content-length" in response.headers:
        return [http_layers.ResponseProtocolError(stream_id, "codex-failover: the stream ends before a rejection "
                                                  "after its output began", http_layers.ErrorCode.CANCEL)]
    return [http_layers.ResponseEndOfMessage(stream_id)]


def _merged(events_: list) -> list:
    """`events_` with each run of data events joined into one (one write to the client, not one a chunk)."""
    out: list = []
    for event in events_:
        if isinstance(event, http_layers.ResponseData) and out and isinstance(out[-1], http_layers.ResponseData):
            out[-1] = http_layers.ResponseData(event.stream_id, out[-1].data + event.data)
        else:
            out.append(event)
    return out


def _sweep(inner: HttpLayer) -> None:
    """Forget the stand-ins of ended answers whose streams are gone (bounded by live streams)."""
    for conn, child in list(inner.connections.items()):
        if isinstance(child, HopLayer) and child.hop.detached and child.hop.stream_id not in inner.streams:
            for http_layer in child.hop.layers:
                http_layer.connections.pop(conn, None)
    for sid in [sid for sid, conn in getattr(inner, "held", {}).items() if conn is _UNCLAIMED and sid not in inner.streams]:
        del inner.held[sid]


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


def _stream_of(root: layer.Layer, flow: http.HTTPFlow) -> HttpStream | None:
    todo, seen = [root], 0
    while todo and seen < _SEARCH_LIMIT:
        node = todo.pop()
        seen += 1
        if isinstance(node, HttpStream) and getattr(node, "flow", None) is flow:
            return node
        todo.extend(_children(node))
    return None


def _routes(stream: HttpStream | None) -> list[tuple[HttpLayer, layer.Layer]] | None:
    """Each HttpLayer above `stream` with the child that leads to it, outermost first; the last
    is the stream's own. None when the stack is not what this module understands."""
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
