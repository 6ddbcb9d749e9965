"""A gated WebSocket's upstream socket on mitmproxy's layers (ws/layer_socket.py over the seam's
mitm/warm_conn.py), in-process in the manner of mitmproxy's layer tests: events in, commands out,
every hook run through the connection handler's own `handle_hook` (so every addon and the socket's
`hooked` see it), no socket opened.

The mitmproxy 12.3.1 facts it relies on (docs/mitmproxy-12.3.1-replay-notes.md §13), each pinned here:
- an upgrade attempt runs `requestheaders` and `request`, then its head goes out with the credential on
  the wire only; a 101 runs `responseheaders` and `response` with `flow.websocket` already set, then
  `websocket_start`, and the stream becomes mitmproxy's WebSocket layer;
- an upstream message runs `websocket_message`, and one dropped there goes nowhere; what goes to the
  client side (a ping, a close) arrives at `_AttemptSource` as the stream's `ResponseData`;
- frames fed from the client side as the stream's `RequestData` reach the upstream as the same
  message (a long non-ASCII text intact: mitmproxy's own injection splits text at 4,000 bytes);
- a close from the client side closes both sides and runs `websocket_end`;
- the layer's server-side extensions are a list the socket can bound (BoundedDeflate).
"""

from __future__ import annotations

import asyncio
import zlib

from mitmproxy import ctx, http
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import Client, ConnectionState, Server
from mitmproxy.proxy import commands, events
from mitmproxy.test import taddons
from test_warm_conn_contract import SECRET
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import CloseConnection, Message, Ping, Pong, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import FrameProtocol

from codex_failover.core.warm_book import Slot, WarmKey
from codex_failover.mitm.addon import FailoverAddon
from codex_failover.mitm.attempt import PLACEHOLDER
from codex_failover.mitm.warm_conn import WarmConnection, _Submit, _ToStream
from codex_failover.ws.bounded_deflate import BoundedDeflate
from codex_failover.ws.conn import WsConn
from codex_failover.ws.layer_socket import LayerSocket

KEY = WarmKey("http", "upstream.test", 80, None, "work")
ACCEPT = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
          b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n")
DEFLATE = b"Sec-WebSocket-Extensions: permessage-deflate\r\n"


def play(conn: WarmConnection, event: events.Event) -> list[commands.Command]:
    return list(conn.layer.handle_event(event))


async def drive(conn: WarmConnection, cmds: list[commands.Command], seen: list[str]) -> list[commands.Command]:
    """Run each hook as the connection handler does (every addon, then the socket); the other commands."""
    out: list[commands.Command] = []
    pending = list(cmds)
    while pending:
        cmd = pending.pop(0)
        if isinstance(cmd, commands.StartHook):
            seen.append(cmd.name)
            await conn.handle_hook(cmd)
            pending = play(conn, events.HookCompleted(cmd)) + pending
        else:
            out.append(cmd)
    return out


def socket_on(conn: WarmConnection) -> LayerSocket:
    client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 8080), state=ConnectionState.OPEN)
    flow = http.HTTPFlow(client, Server(address=("upstream.test", 80)))
    flow.request = http.Request.make("GET", "http://upstream.test/v1/responses", b"", {"host": "upstream.test"})
    headers = http.Headers(host="upstream.test", connection="Upgrade", upgrade="websocket",
                           authorization=SECRET, **{"sec-websocket-version": "13",
                                                    "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
    sock = LayerSocket(flow, "http://upstream.test/v1/responses", headers, "w1#1", "upstream socket 1: work", None)
    sock._hide_secrets()
    sock.conn = conn
    sock.stream_id = next(conn._stream_ids)
    conn.attempts[sock.stream_id] = conn.sockets[sock.stream_id] = sock
    return sock


async def submitted(verdict=None):
    """A socket's upgrade handed to its connection, its request hooks run: (connection, socket,
    hooks seen, the commands after them)."""
    ctx.options.http2 = False
    conn = WarmConnection(KEY, Slot(KEY, 1), ctx.options)
    play(conn, events.Start())
    sock, seen = socket_on(conn), []
    sock.verdict = verdict
    return conn, sock, seen, await drive(conn, play(conn, _Submit(conn.client, sock)), seen)


async def upgraded(extensions: bytes = b""):
    """A socket whose upgrade the fake upstream accepted; its server connection, hooks seen, head sent."""
    conn, sock, seen, cmds = await submitted()
    opened = next(c for c in cmds if isinstance(c, commands.OpenConnection))
    head = b"".join(c.data for c in await drive(conn, play(conn, events.OpenConnectionCompleted(opened, None)), seen)
                    if isinstance(c, commands.SendData))
    await drive(conn, play(conn, events.DataReceived(opened.connection, ACCEPT + extensions + b"\r\n")), seen)
    return conn, sock, opened.connection, seen, head


def sent_to(server, cmds) -> bytes:
    return b"".join(c.data for c in cmds if isinstance(c, commands.SendData) and c.connection is server)


def upstream_reads(data: bytes, deflate: bool = False) -> list:
    """What the upstream's wsproto makes of `data`, the frames the proxy sent it."""
    upstream = Connection(ConnectionType.SERVER, [deflated()] if deflate else [])
    upstream.receive_data(data)
    return list(upstream.events())


def deflated() -> PerMessageDeflate:
    ext = PerMessageDeflate()
    ext.finalize("permessage-deflate")  # (wsproto leaves out an extension not yet negotiated)
    return ext


def run(coro):
    with taddons.context(Proxyserver(), FailoverAddon()):
        return asyncio.run(coro)


def test_the_upgrade_runs_every_hook_and_sends_the_credential_on_the_wire_only():
    async def go():
        conn, sock, server, seen, head = await upgraded()
        assert seen == ["requestheaders", "request", "responseheaders", "response", "websocket_start"]
        assert f"authorization: {SECRET}".encode() in head and b"upgrade: websocket" in head
        assert sock.flow.request.headers["authorization"] == PLACEHOLDER
        assert sock.upgraded.is_set() and sock.open and sock.flow.websocket is not None
        assert not sock.over.is_set() and sock.stream_id in conn.attempts  # the socket goes on
    run(go())


def test_an_upstream_message_reaches_the_gate_once_masked_on_the_flow_and_goes_nowhere_else():
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        upstream = Connection(ConnectionType.SERVER)
        echo = '{"type":"error","message":"bad key sk-proj-AAAAAAAAAAAAAAAAAAAAAAAA"}'
        cmds = await drive(conn, play(conn, events.DataReceived(server, upstream.send(TextMessage(echo)))), seen)
        assert seen[-1] == "websocket_message"
        assert not [c for c in cmds if isinstance(c, commands.SendData)]  # dropped: nothing goes on
        assert await sock.recv() == (echo.encode(), True)  # the gate gets it as it came
        shown = sock.flow.websocket.messages[-1].content
        assert b"sk-proj-AAAA" not in shown and b"bad key" in shown
    run(go())


def test_the_gates_frames_reach_the_upstream_whole_and_a_ping_is_answered():
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        text = "ünïcödé " * 2000  # > 4,000 bytes of multi-byte text: mitmproxy's injection would split it
        frames = sock._client.ws.send(TextMessage(text))
        cmds = await drive(conn, play(conn, _ToStream(conn.client, sock.stream_id, data=frames)), seen)
        got = [e for e in upstream_reads(sent_to(server, cmds)) if isinstance(e, Message)]
        assert "".join(e.data for e in got) == text
        upstream = Connection(ConnectionType.SERVER)
        fed: list[bytes] = []
        sock._client._feed = lambda data: fed.append(data) or asyncio.sleep(0)  # what the socket feeds back
        await drive(conn, play(conn, events.DataReceived(server, upstream.send(Ping(b"p1")))), seen)
        await asyncio.sleep(0)
        assert fed, "the ping reached the client side and was answered"
        cmds = await drive(conn, play(conn, _ToStream(conn.client, sock.stream_id, data=fed[0])), seen)
        assert [e for e in upstream_reads(sent_to(server, cmds)) if isinstance(e, Pong)][0].payload == b"p1"
    run(go())


def test_the_gates_message_goes_in_whole_runs_its_hooks_and_is_framed_once_toward_the_upstream(monkeypatch):
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        handed: list[events.Event] = []

        async def server_event(event):
            handed.append(event)

        async def drained():
            pass

        conn.server_event, conn.drain_writers = server_event, drained  # what the socket hands its connection
        framed = []
        send_data = FrameProtocol.send_data
        monkeypatch.setattr(FrameProtocol, "send_data", lambda self, *a, **k: framed.append(1) or send_data(self, *a, **k))
        text = "ünïcödé " * 2000  # > 4,000 bytes of multi-byte text: mitmproxy's injection would split it
        await sock.send((text.encode(), True))
        assert [e.message.content for e in handed] == [text.encode()]  # whole, no frame of the gate's own
        cmds = await drive(conn, play(conn, handed[0]), seen)
        assert framed == [1]  # framed once, by the layer toward the upstream
        assert seen[-1] == "websocket_message"  # every addon saw it, as any message of the socket
        got = [e for e in upstream_reads(sent_to(server, cmds)) if isinstance(e, Message)]
        assert [(e.data, e.message_finished) for e in got] == [(text, True)]  # one frame: framed once, whole
        shown = sock.flow.websocket.messages
        assert [(m.content, m.from_client) for m in shown] == [(text.encode(), True)]  # shown once (leg.FlowRecord)
    run(go())


def test_a_close_from_the_gate_closes_both_sides_and_ends_the_flow():
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        frame = sock._client.ws.send(CloseConnection(1000, "codex-failover: moved"))
        cmds = await drive(conn, play(conn, _ToStream(conn.client, sock.stream_id, data=frame)), seen)
        closes = [e for e in upstream_reads(sent_to(server, cmds)) if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1000
        assert any(isinstance(c, commands.CloseConnection) and c.connection is server for c in cmds)
        assert seen[-1] == "websocket_end" and sock.over.is_set() and sock.stream_id not in conn.attempts
        assert sock.flow.websocket.close_code == 1000 and sock.flow.websocket.closed_by_client
        assert await sock.recv() is None and not sock.open
    run(go())


def test_a_compressed_upstream_inflates_through_the_bound_and_a_bomb_closes_with_1009(monkeypatch):
    monkeypatch.setattr(WsConn, "max_message", 64 * 1024)

    async def go():
        conn, sock, server, seen, _ = await upgraded(DEFLATE)
        extensions = conn.extensions(sock, "server")
        assert extensions is not None and [type(e) for e in extensions] == [BoundedDeflate]
        assert conn.extensions(sock, "client") == [] and sock._client.ws._proto.extensions == []  # the inside hop
        upstream = Connection(ConnectionType.SERVER, [deflated()])
        fine = upstream.send(TextMessage("x" * 1000))
        await drive(conn, play(conn, events.DataReceived(server, fine)), seen)
        assert await sock.recv() == (b"x" * 1000, True)
        frames = sock._client.ws.send(TextMessage("z" * 5000))
        cmds = await drive(conn, play(conn, _ToStream(conn.client, sock.stream_id, data=frames)), seen)
        sent = sent_to(server, cmds)
        assert len(sent) < 500  # compressed towards the upstream
        assert "".join(e.data for e in upstream_reads(sent, deflate=True) if isinstance(e, Message)) == "z" * 5000
        bomb = upstream.send(TextMessage("y" * (4 * 1024 * 1024)))  # 4 MiB that deflates to a few KiB
        assert len(bomb) < 64 * 1024
        cmds = await drive(conn, play(conn, events.DataReceived(server, bomb)), seen)
        assert seen[-1] == "websocket_end" and sock.flow.websocket.close_code == 1009
        closes = [e for e in upstream_reads(sent_to(server, cmds), deflate=True) if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1009
        assert await sock.recv() is None
    run(go())


def test_a_refused_upgrade_keeps_its_body_bounded_and_masked_and_its_verdict_before_any_save():
    async def go():
        verdicts = []
        conn, sock, seen, cmds = await submitted(
            lambda exc: verdicts.append(exc) or ("❌", "upgrade rejected (overloaded) via direct"))
        opened = next(c for c in cmds if isinstance(c, commands.OpenConnection))
        await drive(conn, play(conn, events.OpenConnectionCompleted(opened, None)), seen)
        body = b'{"error":{"message":"overloaded, key sk-proj-BBBBBBBBBBBBBBBBBBBBBBBB"}}' + b" " * 20_000
        gz = zlib.compress(body, wbits=31)
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                f"content-length: {len(gz)}\r\n\r\n").encode()
        await drive(conn, play(conn, events.DataReceived(opened.connection, head + gz)), seen)
        assert seen[-2:] == ["responseheaders", "response"] and sock.over.is_set()
        assert verdicts and verdicts[0].status == 503  # a HandshakeRejected, judged before the final hook
        assert sock.flow.marked == "❌" and "upgrade rejected (overloaded)" in sock.flow.comment
        shown = sock.flow.response.content
        assert b"overloaded" in shown and b"sk-proj-BBBB" not in shown and "content-encoding" not in sock.flow.response.headers
        assert len(sock._body) <= 65536
    run(go())


# -- found by review: each of these failed before its fix ----------------------------------------------

def test_a_socket_to_another_host_sends_that_hosts_name():
    """A spare whose base_url is on another host than the client's: its Host header is the spare's."""
    async def go():
        ctx.options.http2 = False
        conn = WarmConnection(KEY, Slot(KEY, 1), ctx.options)
        play(conn, events.Start())
        client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 8080), state=ConnectionState.OPEN)
        flow = http.HTTPFlow(client, Server(address=("chatgpt.com", 443)))
        flow.request = http.Request.make("GET", "https://chatgpt.com/backend-api/codex/responses", b"",
                                         {"host": "chatgpt.com"})
        headers = http.Headers(host="chatgpt.com", connection="Upgrade", upgrade="websocket",
                               **{"sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
        sock = LayerSocket(flow, "http://upstream.test/v1/responses", headers, "w1#1", "socket", None)
        assert sock.flow.request.headers["host"] == "upstream.test"
    run(go())


def test_pings_cost_one_pong_task_answering_the_latest_and_a_flood_closes_the_socket():
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        upstream = Connection(ConnectionType.SERVER)
        fed: list[bytes] = []
        sock._client._feed = lambda data: fed.append(data) or asyncio.sleep(0)
        burst = b"".join(upstream.send(Ping(str(i).encode())) for i in range(50))
        await drive(conn, play(conn, events.DataReceived(server, burst)), seen)
        pending = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ClientSide._pong"]
        assert len(pending) == 1
        await asyncio.wait(pending, timeout=2)
        answers = [e for e in upstream_reads_as_server(fed) if isinstance(e, Pong)]
        assert [p.payload for p in answers] == [b"49"] and sock.open
        aborted: list[bool] = []
        sock.conn.close = lambda why="": aborted.append(True)
        flood = b"".join(upstream.send(Ping(b"x")) for _ in range(2000))
        await drive(conn, play(conn, events.DataReceived(server, flood)), seen)
        assert sock.close_code == 1008 and aborted and await sock.recv() is None
    run(go())


def upstream_reads_as_server(frames: list[bytes]) -> list:
    upstream = Connection(ConnectionType.SERVER)
    upstream.receive_data(b"".join(frames))
    return list(upstream.events())


def test_reading_the_upstream_pauses_while_a_messages_hooks_run():
    """mitmproxy reads on while a hook runs and queues what it read: the socket stops the reads."""
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        calls: list[bool] = []
        conn.set_reading = calls.append
        upstream = Connection(ConnectionType.SERVER)
        await drive(conn, play(conn, events.DataReceived(server, upstream.send(TextMessage("a")))), seen)
        assert calls == [False, True]
    run(go())


def test_an_upgrade_an_addon_answers_keeps_its_body_for_the_verdict():
    class Answers:
        def request(self, flow):
            if flow.metadata.get("codex_failover.attempt"):
                flow.response = http.Response.make(429, b'{"error":{"type":"usage_limit_reached","message":"limit"}}',
                                                   {"content-type": "application/json"})

    async def go():
        conn, sock, seen, _ = await submitted()
        assert sock.over.is_set() and sock.failure.status == 429
        assert b"usage_limit_reached" in sock.failure.body and b"usage_limit_reached" in sock.flow.response.content

    with taddons.context(Proxyserver(), FailoverAddon(), Answers()):
        asyncio.run(go())


def test_a_second_close_waits_for_the_first_ones_handshake():
    async def go():
        conn, sock, server, seen, _ = await upgraded()
        aborted: list[bool] = []
        sock.abort = lambda: aborted.append(True)
        sock._client._feed = lambda data: asyncio.sleep(0)
        sock.close(1000, "codex-failover: moved")
        sock.close(1011)
        assert aborted == [] and sock.close_code == 1000
    run(go())


def test_a_connection_cancelled_mid_event_is_still_closed_and_forgotten(monkeypatch):
    """mitmproxy's handle_connection skips its own cleanup when a close cancels it inside server_event."""
    from mitmproxy.proxy import server as proxy_server

    async def cancelled(self, connection):
        raise asyncio.CancelledError("closed by command")

    class Writer:
        closed = False

        def close(self):
            self.closed = True

    async def go():
        ctx.options.http2 = False
        conn = WarmConnection(KEY, Slot(KEY, 1), ctx.options)
        kept = Server(address=("upstream.test", 80))
        conn.kept, writer, gone = kept, Writer(), []
        conn.transports[kept] = proxy_server.ConnectionIO(handler=None, reader=None, writer=writer)
        conn.on_closed = gone.append
        monkeypatch.setattr(proxy_server.ConnectionHandler, "handle_connection", cancelled)
        try:
            await conn.handle_connection(kept)
        except asyncio.CancelledError:
            pass
        assert writer.closed and kept not in conn.transports and gone == [conn]
    run(go())
