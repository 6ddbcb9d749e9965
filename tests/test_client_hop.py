"""The hop's bookkeeping in the client's layers (mitm/client_hop.py), on real mitmproxy layers."""

from __future__ import annotations

from mitmproxy.connection import Client, ConnectionState, Server
from mitmproxy.options import Options
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import ErrorCode, HttpLayer, HTTPMode, RequestProtocolError

from codex_failover.mitm import client_hop
from codex_failover.mitm.client_hop import ClientHop, HopLayer


def http_layer() -> HttpLayer:
    client = Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), state=ConnectionState.OPEN)
    return HttpLayer(Context(client, Options()), HTTPMode.transparent)


def stand_in(outer: HttpLayer, inner: HttpLayer, stream_id: int, detached: bool) -> Server:
    conn = Server(address=("upstream.test", 443))
    hop = ClientHop(handler=None, conn=conn, stream_id=stream_id, layers=[outer, inner], abort=lambda: None)
    hop.detached = detached
    outer.connections[conn] = object()  # the child that leads down, as attach registers it
    inner.connections[conn] = HopLayer(inner.context.fork(), hop)
    return conn


def test_ended_stand_ins_are_forgotten_once_their_streams_are_gone():
    outer, inner = http_layer(), http_layer()
    inner.streams[3] = object()  # stream 3 is still alive; 1 and 5 are gone
    gone = stand_in(outer, inner, 1, detached=True)
    ended_but_alive = stand_in(outer, inner, 3, detached=True)
    streaming = stand_in(outer, inner, 5, detached=False)
    client_hop._sweep(inner)
    assert gone not in inner.connections
    assert gone not in outer.connections, "removed from every layer it was registered in"
    assert ended_but_alive in inner.connections, "its stream may still send it the client's error"
    assert streaming in inner.connections
    assert streaming in outer.connections


def test_an_ended_stand_in_drops_what_its_stream_still_sends():
    outer, inner = http_layer(), http_layer()
    conn = stand_in(outer, inner, 1, detached=True)
    hop = inner.connections[conn].hop
    stopped = []
    hop.abort = lambda: stopped.append(True)
    error = RequestProtocolError(1, "client disconnected", ErrorCode.CLIENT_DISCONNECTED)
    commands = list(inner.connections[conn].handle_event(error))
    assert commands == []
    assert stopped == [], "an answer that ended is not aborted again"


