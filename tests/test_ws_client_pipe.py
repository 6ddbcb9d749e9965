"""ws/client_pipe.py: the gated socket's client side in process (the 101's headers; `InProcessClient`, the
gate's end: whole messages, control frames only across the stand-in)."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy import http
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import CloseConnection, Ping, Pong, TextMessage
from wsproto.utilities import generate_accept_token

from codex_failover.ws.client_pipe import InProcessClient, upgrade_headers
from codex_failover.ws.conn import WsConn

KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def request_headers(*extra):
    return http.Headers([(b"sec-websocket-key", KEY.encode()), (b"sec-websocket-version", b"13"), *extra])


def test_the_101_has_the_accept_token_and_the_upstreams_own_headers_but_not_its_handshake():
    upstream = [(b"x-codex-turn-state", b"ts-1"), (b"sec-websocket-accept", b"upstream's"), (b"connection", b"upgrade")]
    headers = upgrade_headers(request_headers(), upstream)
    assert headers == [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
                       (b"sec-websocket-accept", generate_accept_token(KEY.encode())), (b"x-codex-turn-state", b"ts-1")]


def test_deflate_is_accepted_only_when_offered():
    offered = upgrade_headers(request_headers((b"sec-websocket-extensions", b"permessage-deflate; client_max_window_bits")), [])
    assert (b"sec-websocket-extensions", b"permessage-deflate; client_max_window_bits=15") in offered
    unknown = upgrade_headers(request_headers((b"sec-websocket-extensions", b"x-webkit-deflate-frame")), [])
    assert not [k for k, _ in unknown if k == b"sec-websocket-extensions"]


class Hop:
    """The held client stream as the gate's end sees it: what it writes toward the client's layer."""

    def __init__(self):
        self.writes: list[bytes] = []
        self.sent: list[tuple[bytes, bool]] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    async def send_message(self, content: bytes, is_text: bool) -> None:
        self.sent.append((content, is_text))


def client_frames(*events) -> bytes:
    """What mitmproxy's layer sends on toward the stand-in (a client's frames: masked)."""
    ws = Connection(ConnectionType.CLIENT)
    return b"".join(ws.send(e) for e in events)


def server_events(data: bytes) -> list:
    ws = Connection(ConnectionType.CLIENT)
    ws.receive_data(data)
    return list(ws.events())


def test_messages_come_and_go_whole_in_order_and_the_end_is_none():
    async def go():
        hop = Hop()
        client = InProcessClient(hop)
        client.took(b"one", True)
        client.took(b"\x00two", False)
        assert await client.recv() == (b"one", True) and await client.recv() == (b"\x00two", False)
        waiting = asyncio.ensure_future(client.recv())
        await asyncio.sleep(0)
        assert not waiting.done()
        await client.send((b"answer", True))
        assert hop.sent == [(b"answer", True)] and hop.writes == []  # whole, into the layer: no frame of ours
        client.control(b"")  # the client is gone
        assert await asyncio.wait_for(waiting, 1) is None and client.close_code == 1006 and not client.open
        await client.send((b"late", True))
        assert hop.sent == [(b"answer", True)]
    asyncio.run(asyncio.wait_for(go(), 5))


def test_a_ping_is_answered_and_a_close_is_answered_then_the_end_written_once():
    hop = Hop()
    client = InProcessClient(hop)
    client.control(client_frames(Ping(b"p1")))
    assert [type(e) for e in server_events(hop.writes[0])] == [Pong]
    client.control(client_frames(CloseConnection(1000, "bye")))
    assert client.close_code == 1000 and client.close_reason == "bye"
    closes = [e for e in server_events(hop.writes[1]) if isinstance(e, CloseConnection)]
    assert closes[0].code == 1000 and hop.writes[2:] == [b""]
    client.close(1012)  # (the gate's end, after): nothing more
    assert hop.writes[3:] == []


@pytest.mark.parametrize("code, reason", [(1012, "codex-failover: reconnect"), (1000, "")])
def test_the_gates_close_is_a_close_frame_with_its_code_then_the_end(code, reason):
    hop = Hop()
    client = InProcessClient(hop)
    client.close(code, reason)
    closes = [e for e in server_events(hop.writes[0]) if isinstance(e, CloseConnection)]
    assert (closes[0].code, closes[0].reason) == (code, reason) and hop.writes[1:] == [b""]
    assert client.close_code == code and not client.open
    client.close(1011)
    assert len(hop.writes) == 2 and client.close_code == code


def test_a_message_over_the_limit_closes_with_1009_and_is_not_taken(monkeypatch):
    async def go():
        monkeypatch.setattr(WsConn, "max_message", 10)
        hop = Hop()
        client = InProcessClient(hop)
        client.took(b"y" * 11, True)
        assert client.close_code == 1009 and await client.recv() is None
        assert [e.code for e in server_events(hop.writes[0]) if isinstance(e, CloseConnection)] == [1009]
    asyncio.run(asyncio.wait_for(go(), 5))


def test_a_message_framed_on_to_the_stand_in_means_the_layers_are_not_as_pinned_and_closes():
    hop = Hop()
    client = InProcessClient(hop)
    client.control(client_frames(TextMessage("hi")))
    assert client.close_code == 1011 and hop.writes[-1] == b""


def test_a_client_gone_while_a_message_drains_ends_the_socket_not_the_gate():
    class Gone(Hop):
        async def send_message(self, content: bytes, is_text: bool) -> None:
            raise ConnectionResetError("the client went")

    async def go():
        hop = Gone()
        client = InProcessClient(hop)
        await client.send((b"answer", True))
        assert client.close_code == 1006 and not client.open and hop.writes[-1:] == [b""]
        assert await client.recv() is None
    asyncio.run(asyncio.wait_for(go(), 5))


def test_messages_the_gate_has_not_read_are_bounded(monkeypatch):
    async def go():
        monkeypatch.setattr(WsConn, "max_message", 10)
        hop = Hop()
        client = InProcessClient(hop)
        for _ in range(2):
            client.took(b"y" * 10, True)  # 20 unread: at the bound
        assert client.open
        assert await client.recv() == (b"y" * 10, True)
        client.took(b"y" * 10, True)  # 20 unread again: still taken
        client.took(b"y", True)  # past twice the largest message: closed
        assert client.close_code == 1009
    asyncio.run(asyncio.wait_for(go(), 5))
