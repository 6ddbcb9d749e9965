"""The kept connection's layers in-process, in the manner of mitmproxy's own layer tests (events in,
commands out, no sockets): each mitmproxy 12.3.1 fact `mitm/warm_conn.py` relies on is pinned here,
so a mitmproxy release that changes one fails this file by name, not an end-to-end test by timeout.

Facts (docs/mitmproxy-12.3.1-replay-notes.md §9):
- an attempt handed to `_AttemptSource` becomes an `HttpStream` of mitmproxy's `HttpLayer`, whose
  hooks are blocking `StartHook` commands (the connection handler runs them, every addon sees them);
- the stream's `GetHttpConnection` reaches `HttpLayer.get_connection` with a spec that
  `connection_spec_matches` the kept server, and a new one is dialled with `OpenConnection`;
- a second attempt asking meanwhile waits in `waiting_for_establishment` and gets the same
  connection once `register_connection` runs (HTTP/2), so a credential's attempts share one dial;
- the request head goes out as a `SendData` produced while the server connection's layers handle the
  stream's `SendHttp`: the attempt's real secrets are on its flow only then, and the flow holds
  placeholders again before any command runs;
- an attempt cancelled while it waits for its connection gets the connection's error, never a byte.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from mitmproxy import ctx, http
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import Client, ConnectionState, Server
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.test import taddons

from codex_failover.core.warm_book import Slot, WarmKey
from codex_failover.mitm.addon import FailoverAddon
from codex_failover.mitm.attempt import PLACEHOLDER, Attempt
from codex_failover.mitm.warm_conn import WarmConnection, _Submit

KEY = WarmKey("http", "upstream.test", 80, None, "work")
SECRET = "Bearer sk-test-contract-secret"


class Engine:
    """What an Attempt asks of its engine here: nothing (the test hands it to the connection)."""


def attempt(label: str) -> Attempt:
    client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 8080), state=ConnectionState.OPEN)
    flow = http.HTTPFlow(client, Server(address=("upstream.test", 80)))
    request = http.Request.make("POST", "http://upstream.test/v1/responses", b'{"stream":true}',
                                {"authorization": SECRET, "content-type": "application/json"})
    a = Attempt(flow, request, label, 1, Engine())
    a._hide_secrets()  # as start() does: the flow shows placeholders from here on
    return a


def play(conn: WarmConnection, event: events.Event) -> list[commands.Command]:
    return list(conn.layer.handle_event(event))


def submit(conn: WarmConnection, a: Attempt) -> list[commands.Command]:
    a.stream_id = next(conn._stream_ids)
    conn.attempts[a.stream_id] = a
    return play(conn, _Submit(conn.client, a))


def hooks_through(conn: WarmConnection, cmds: list[commands.Command], names=("requestheaders", "request")):
    """Answer the stream's hooks as the connection handler would; the commands after them."""
    out = list(cmds)
    for name in names:
        hook = next(c for c in out if isinstance(c, commands.StartHook))
        assert hook.name == name and hook.blocking, hook
        out = play(conn, events.HookCompleted(hook))
    return out


def new_connection(h2: bool) -> WarmConnection:
    ctx.options.http2 = h2
    conn = WarmConnection(KEY, Slot(KEY, 1), ctx.options)
    play(conn, events.Start())
    return conn


def run(coro):
    # ctx.options as mitmdump has them: the proxy core's (validate_inbound_headers...) and the addon's.
    with taddons.context(Proxyserver(), FailoverAddon()):
        return asyncio.run(coro)


def test_an_attempt_runs_every_hook_then_dials_the_kept_connection():
    async def go():
        conn = new_connection(h2=False)
        a = attempt("r1#1")
        cmds = hooks_through(conn, submit(conn, a))
        opens = [c for c in cmds if isinstance(c, commands.OpenConnection)]
        assert len(opens) == 1 and opens[0].connection.address == ("upstream.test", 80), cmds
        assert conn.kept is opens[0].connection
        assert not a.sent and a.flow.request.headers["authorization"] == PLACEHOLDER
        return conn, a, opens[0]
    run(go())


def test_the_head_carries_the_secret_only_on_the_wire_and_the_flow_never_does():
    async def go():
        conn = new_connection(h2=False)
        a = attempt("r1#1")
        cmds = hooks_through(conn, submit(conn, a))
        dial = next(c for c in cmds if isinstance(c, commands.OpenConnection))
        dial.connection.state = ConnectionState.OPEN
        dial.connection.timestamp_start = dial.connection.timestamp_tcp_setup = 1.0
        out = play(conn, events.OpenConnectionCompleted(dial, None))
        writes = [c for c in out if isinstance(c, commands.SendData) and c.connection is dial.connection]
        assert writes, out
        head = b"".join(w.data for w in writes)
        assert head.startswith(b"POST /v1/responses HTTP/1.1") and SECRET.encode() in head
        assert a.sent  # the head left: the secrets are never put on the flow again
        assert a.flow.request.headers["authorization"] == PLACEHOLDER
        assert conn.ready.done() and conn.ready.result() is None
    run(go())


def test_a_second_attempt_waits_for_the_same_dial_on_http2():
    async def go():
        conn = new_connection(h2=True)
        first, second = attempt("r1#1"), attempt("r2#1")
        cmds = hooks_through(conn, submit(conn, first))
        dial = next(c for c in cmds if isinstance(c, commands.OpenConnection))
        later = hooks_through(conn, submit(conn, second))
        assert not [c for c in later if isinstance(c, commands.OpenConnection)], later  # no second dial
        assert dial.connection in conn.layer.waiting_for_establishment
        assert len(conn.layer.waiting_for_establishment[dial.connection]) == 2
    run(go())


def test_an_attempt_cancelled_while_its_connection_is_dialled_never_gets_it():
    async def go():
        conn = new_connection(h2=True)
        first, second = attempt("r1#1"), attempt("r2#1")
        dial = next(c for c in hooks_through(conn, submit(conn, first)) if isinstance(c, commands.OpenConnection))
        hooks_through(conn, submit(conn, second))
        second.abandoned = True  # WarmConnection.cancel sets it for an attempt not yet sent
        dial.connection.state = ConnectionState.OPEN
        dial.connection.alpn = b"h2"
        dial.connection.timestamp_start = dial.connection.timestamp_tcp_setup = 1.0
        out = play(conn, events.OpenConnectionCompleted(dial, None))
        hooks = [c for c in out if isinstance(c, http_layers.HttpErrorHook)]
        assert [h.flow for h in hooks] == [second.flow], out  # the abandoned one ends with an error
        assert second.flow.error is not None and not second.sent
        assert first.sent
    run(go())


def test_a_goaway_fails_only_the_streams_the_server_never_processed():
    """mitmproxy's `Http2Client` and h2, as `_GoawayHttp2Client` relies on them: `streams` holds h2's
    stream ids; a `ResponseProtocolError` yielded from `handle_h2_event` is mapped back to the outer
    id; h2's connection state machine is `h2_conn.state_machine.state`, which a received GOAWAY sets to
    CLOSED and which, put back to CLIENT_OPEN, lets the kept streams' frames in."""
    import h2.connection
    import h2.errors
    import h2.events
    from mitmproxy.proxy.context import Context
    from mitmproxy.proxy.layers.http._http2 import Http2Client

    from codex_failover.mitm import warm_conn

    async def go():
        client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 8080), state=ConnectionState.OPEN)
        context = Context(client, ctx.options)
        context.server = Server(address=("upstream.test", 443))
        context.server.state = ConnectionState.OPEN
        layer = Http2Client(context)
        told = []
        layer.__class__, layer.warm = warm_conn._GoawayHttp2Client, SimpleNamespace(goaway=lambda: told.append(1))
        layer.streams = {1: None, 3: None}
        layer.their_stream_id = {1: 11, 3: 13}
        layer.h2_conn.state_machine.state = h2.connection.ConnectionState.CLOSED  # as h2 leaves it
        event = h2.events.ConnectionTerminated()
        event.error_code, event.last_stream_id = h2.errors.ErrorCodes.NO_ERROR, 1
        gen = layer.handle_h2_event(event)
        out = []
        try:
            while True:
                out.append(next(gen))
        except StopIteration as stop:
            closed = stop.value
        failed = [c.event for c in out if isinstance(c, http_layers.ReceiveHttp)]
        assert [(e.stream_id, e.message) for e in failed] == [(3, warm_conn.NEVER_PROCESSED)]
        assert closed is False and list(layer.streams) == [1] and told == [1]
        assert layer.h2_conn.state_machine.state == h2.connection.ConnectionState.CLIENT_OPEN
    run(go())


def test_a_busy_http11_connection_is_never_handed_a_second_attempt():
    """An attempt the book assigned while the connection was being dialled, whose request reaches the
    layer once the connection is up as HTTP/1.1 and busy with the first: `Http1Client` serves one
    stream at a time (its `stream_id` is set while busy; a second stream trips its assertion and
    crashes the connection), so the second attempt dials a connection of its own."""
    async def go():
        conn = new_connection(h2=False)
        first, second = attempt("r1#1"), attempt("r2#1")
        cmds = hooks_through(conn, submit(conn, first))
        dial = next(c for c in cmds if isinstance(c, commands.OpenConnection))
        dial.connection.state = ConnectionState.OPEN
        dial.connection.timestamp_start = dial.connection.timestamp_tcp_setup = 1.0
        play(conn, events.OpenConnectionCompleted(dial, None))
        assert first.sent
        out = hooks_through(conn, submit(conn, second))
        opens = [c for c in out if isinstance(c, commands.OpenConnection)]
        assert len(opens) == 1 and opens[0].connection is not dial.connection, out
        assert not any(isinstance(c, commands.SendData) and c.connection is dial.connection for c in out)
    run(go())
