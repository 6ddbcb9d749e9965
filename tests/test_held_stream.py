"""The held client stream (mitm/held_stream.py): its lifecycle's table (core/held_states.py), and its
bookkeeping in the client's layers (mitm/held_layer.py), on real mitmproxy layers."""

from __future__ import annotations

import pytest
from mitmproxy.connection import Client, ConnectionState, Server
from mitmproxy.options import Options
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import ErrorCode, HttpLayer, HTTPMode, RequestProtocolError

from codex_failover.core.held_states import TRANSITIONS, HeldEvent as E, HeldState as S, HeldStateError, after
from codex_failover.mitm import held_layer
from codex_failover.mitm.held_layer import HopLayer, StreamWire
from codex_failover.mitm.held_stream import HeldStream

# -- the lifecycle (core/held_states.py) ------------------------------------------------------------

PATHS = [
    ("served on its own stream", [E.DIRECT, E.RELEASE, E.END], S.ENDED),
    ("failed over to the stand-in", [E.DIRECT, E.CANCEL, E.ANSWER, E.END], S.ENDED),
    ("answered by the stand-in from the start", [E.STAND_IN, E.ANSWER, E.END], S.ENDED),
    ("recovery's heartbeat while attempt 1 rides", [E.DIRECT, E.ANSWER, E.CANCEL, E.END], S.ENDED),
    ("a gated WebSocket", [E.STAND_IN, E.UPGRADE, E.END], S.ENDED),
    ("the client left while the run chose", [E.CLIENT_LEFT], S.ENDED),
    ("a commit that finds the client gone", [E.DIRECT, E.CLIENT_LEFT, E.RELEASE], S.ENDED),
]


@pytest.mark.parametrize("name,events,end", PATHS, ids=[p[0] for p in PATHS])
def test_lifecycle_paths(name, events, end):
    state = S.CHOOSING
    for event in events:
        state = after(state, event)
    assert state is end


@pytest.mark.parametrize("state,event", [
    (S.CHOOSING, E.RELEASE),  # nothing to release before attempt 1 rode the stream
    (S.STAND_IN, E.RELEASE),
    (S.DIRECT_RELEASED, E.ANSWER),  # a released stream is answered by its upstream, never the stand-in
    (S.ANSWERING, E.UPGRADE),
    (S.UPGRADED, E.ANSWER),
    (S.DIRECT_HELD, E.UPGRADE),  # a held upgrade never rides the stream
])
def test_moves_the_table_does_not_have_are_bugs(state, event):
    with pytest.raises(HeldStateError, match=state.value):
        after(state, event)


def test_every_state_ends_and_ended_takes_everything():
    for state in S:
        assert TRANSITIONS[(state, E.END)] is S.ENDED and TRANSITIONS[(state, E.CLIENT_LEFT)] is S.ENDED
    assert all(TRANSITIONS[(S.ENDED, event)] is S.ENDED for event in E)


# -- the stand-in's bookkeeping in the layers ---------------------------------------------------------

def http_layer() -> HttpLayer:
    client = Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), state=ConnectionState.OPEN)
    return HttpLayer(Context(client, Options()), HTTPMode.transparent)


def stand_in(outer: HttpLayer, inner: HttpLayer, stream_id: int, ended: bool) -> Server:
    """A held stream's stand-in, made as a stream that needs one gets it (`StreamWire.stand_in`)."""
    wire = StreamWire(handler=None, stream_id=stream_id, routes=[(outer, object()), (inner, object())], via=None,
                      target=(("upstream.test", 443), True, None))
    held = HeldStream(wire, f"flow-{stream_id}", abort=lambda: None)
    if ended:
        held.state = S.ENDED
    conn = wire.stand_in()
    assert isinstance(inner.connections[conn], HopLayer) and conn in outer.connections, "registered in both layers"
    return conn


def test_ended_stand_ins_are_forgotten_once_their_streams_are_gone():
    outer, inner = http_layer(), http_layer()
    inner.streams[3] = object()  # stream 3 is still alive; 1 and 5 are gone
    gone = stand_in(outer, inner, 1, ended=True)
    ended_but_alive = stand_in(outer, inner, 3, ended=True)
    streaming = stand_in(outer, inner, 5, ended=False)
    held_layer._sweep(inner)
    assert gone not in inner.connections
    assert gone not in outer.connections, "removed from every layer it was registered in"
    assert ended_but_alive in inner.connections, "its stream may still send it the client's error"
    assert streaming in inner.connections
    assert streaming in outer.connections


def test_an_ended_stand_in_drops_what_its_stream_still_sends():
    outer, inner = http_layer(), http_layer()
    conn = stand_in(outer, inner, 1, ended=True)
    held = inner.connections[conn].wire.held
    stopped = []
    held.abort = lambda: stopped.append(True)
    error = RequestProtocolError(1, "client disconnected", ErrorCode.CLIENT_DISCONNECTED)
    commands = list(inner.connections[conn].handle_event(error))
    assert commands == []
    assert stopped == [], "an answer that ended is not aborted again"


def test_a_paused_direct_upstream_is_read_again_when_the_stream_ends_before_its_buffer_drained():
    """An HTTP/2 client whose window stays shut: attempt 1's upstream is paused while mitmproxy buffers
    past its bound. If the stream ends first (the client resets it; the last read held the end), the
    upstream is read again all the same: its connection may carry the client's other streams."""
    import asyncio

    class Wire:
        held = None

        def h2_over(self) -> bool:
            return True

        async def h2_drained(self, gone) -> None:
            while not gone():
                await asyncio.sleep(0)

    class Direct:
        paused = False

        def __init__(self):
            self.reading: list[bool] = []

        def set_reading(self, on: bool, shared_too: bool = False) -> None:
            self.reading.append(on)

    async def go():
        stream = HeldStream(Wire(), "f1", lambda: None)  # type: ignore[arg-type]
        direct = stream.direct = Direct()
        stream.handed()  # past the bound: paused, resumed once drained
        assert direct.reading == [False]
        stream.state, stream.direct = S.ENDED, None  # as `detach` leaves it
        for _ in range(5):
            await asyncio.sleep(0)
        assert direct.reading == [False, True]

    asyncio.run(asyncio.wait_for(go(), 5))


def test_a_turn_for_a_tunnel_below_passes_an_outer_held_layer_on():
    """An HTTP/1 client's connection may hold an absolute-form request (its root HttpLayer becomes a
    HeldHttpLayer) and then tunnel with CONNECT: the tunnel's HttpLayer's turns cross the root one by
    their own key, routed down as any connection's events are, not taken as the root's own."""
    from mitmproxy.addons.proxyserver import Proxyserver
    from mitmproxy.proxy import layer

    class Tunnel(layer.Layer):
        def __init__(self, context):
            super().__init__(context)
            self.seen: list = []

        def _handle_event(self, event):
            self.seen.append(event)
            yield from ()

    options = Options()
    Proxyserver().load(options)
    outer = http_layer()
    outer.context.options = options
    tunnel = Tunnel(outer.context.fork())
    outer.__class__ = held_layer.HeldHttpLayer
    outer.held, outer.turns = {}, held_layer._turn_key([(outer, None)])
    inner_key = held_layer._turn_key([(outer, tunnel), (None, None)])  # the tunnel's, as `attach` registers it
    turn = held_layer.DirectTurn(inner_key, "release", 1)
    assert list(outer.handle_event(turn)) == [] and tunnel.seen == [turn]
