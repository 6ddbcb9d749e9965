"""The WebSocket gate's driver (ws/gate.GateSession) in-process: both sockets are scripted (the
dialer's `open_upstream` and the client's accepted socket are replaced), so no socket is opened. Each
upstream answers a `response.create` with a scripted turn; what the client receives, how its socket
closed, and what the pool learnt are read afterwards. The turn's decisions themselves are the
request machine's (tests/test_request_machine.py::test_websocket_turn)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from types import SimpleNamespace

import pytest
from fake_upstream import OVERLOADED, Turn, ws_text
from mitmproxy import http

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.affinity import Affinity
from codex_failover.core.auth import APIKEY, AuthMaterial
from codex_failover.core.health import Health
from codex_failover.core.planner import client_key
from codex_failover.core.provenance import Provenance
from codex_failover.core.recovery import Slots
from codex_failover.core.routes import RouteHealth
from codex_failover.core.usage import UsageBook
from codex_failover.net.socks_bridge import SocksBridges
from codex_failover.rules_file import load_rules
from codex_failover.shared import Shared
from codex_failover.ws import dial as ws_dial, gate as ws_gate


@pytest.fixture(autouse=True)
def _own_dial(monkeypatch):
    """Sessions over the fallback's own sockets (`open_upstream` and the client's, scripted here).
    The same session on mitmproxy's layers: tests/test_e2e_websocket.py and the real CLI's tests."""
    monkeypatch.setenv("CODEX_FAILOVER_FALLBACK", "wsleg")

RULES = load_rules()
CLIENT = AuthMaterial(APIKEY, "tok-client")


class FakeSocket:
    """A WsConn as the gate uses it. An upstream one answers each create with `turns.pop(0)`: a
    list of message texts (None in it: the upstream closes there)."""

    def __init__(self, name: str, turns=()):
        self.name, self.turns = name, list(turns)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.open, self.close_code, self.close_reason = True, None, ""
        self.response_headers: list = []
        self.after_turn: list = []  # (a client) what it sends once a turn it received completed


    async def recv(self):
        item = await self.inbox.get()
        if item is None:
            self.open = False
            self.close_code = self.close_code or 1000
        return item

    async def send(self, message) -> None:
        self.sent.append(message)
        text = message[0] if isinstance(message[0], str) else message[0].decode()
        if '"response.completed"' in text and self.after_turn:
            self.inbox.put_nowait(self.after_turn.pop(0))
        if '"response.create"' in text and self.turns:
            for reply in self.turns.pop(0):
                self.inbox.put_nowait(None if reply is None else (reply.encode(), True))

    def close(self, code: int = 1000, reason: str = "") -> None:
        if self.open:
            self.open, self.close_code, self.close_reason = False, code, reason
            self.inbox.put_nowait(None)

    def texts(self) -> list[str]:
        return [m[0] if isinstance(m[0], str) else m[0].decode() for m in self.sent]


def good(label: str) -> list[str]:
    turn = Turn(label, 2, encode=ws_text)
    return turn.handshake() + turn.answer()


def overloaded(label: str) -> list[str]:
    turn = Turn(label, 2, encode=ws_text)
    return turn.handshake() + [turn.overload_error()]


def refused(label: str) -> list[str]:
    turn = Turn(label, 2, encode=ws_text)
    return [turn.wrapped(401, {"type": "invalid_request_error", "code": "invalid_api_key", "message": "bad key"})]


def create(**extra) -> tuple[bytes, bool]:
    return json.dumps({"type": "response.create", "model": "gpt-fake", "input": [], **extra}).encode(), True


def world(monkeypatch, creds, upstreams: dict[str, FakeSocket | list[FakeSocket]], use_client=False, **policy):
    """`upstreams`: each credential's socket, or its sockets in the order they are dialled."""
    health = Health()
    pool = PoolConfig(tuple(Credential(c, AuthMaterial(APIKEY, f"tok-{c}"), "https://api.example/v1", "$X") for c in creds),
                      Policy(use_client_credential=use_client, bootstrap_timeout=10.0, **policy))
    shared = Shared(pool, RULES, health, RouteHealth(), Affinity(), UsageBook(), SocksBridges(), relay=None, engine=None,
                    attempts={}, notices=set(), recovery_slots=Slots(), upstream_tls=ssl.create_default_context(),
                    provenance=Provenance())
    dialled: list[str] = []

    async def open_upstream(target, fields, via, bridges, tls, connect_timeout, response_timeout, deflate):
        token = {k.lower(): v for k, v in fields}[b"authorization"].decode().removeprefix("Bearer tok-")
        dialled.append(token)
        sock = upstreams[token]
        return sock.pop(0) if isinstance(sock, list) else sock

    monkeypatch.setattr(ws_dial, "open_upstream", open_upstream)
    flow = http.HTTPFlow(SimpleNamespace(id="c1"), None)
    flow.request = http.Request.make("GET", "https://api.example/v1/responses", b"",
                                     {"authorization": "Bearer tok-client", "upgrade": "websocket"})
    return shared, flow, dialled


async def serve(shared, flow, client: FakeSocket, messages, monkeypatch, quiet: float = 0.2) -> ws_gate.GateSession:
    """Open the session, let the client send `messages` (then leave once the client socket went
    quiet for `quiet` seconds), and run it to its end."""
    session, why = await ws_gate.WebsocketGate().open(flow, shared)
    assert session is not None, why
    monkeypatch.setattr(ws_gate.WsConn, "accept", staticmethod(lambda *args: client))
    for message in messages:
        client.inbox.put_nowait(message)

    async def leave_when_quiet():
        seen = -1
        while seen != len(client.sent):  # nothing new for a while: the client is done
            seen = len(client.sent)
            await asyncio.sleep(quiet)
        client.close(1000)

    leaving = asyncio.ensure_future(leave_when_quiet())
    await asyncio.wait_for(session.serve(b"", None, None), 10)
    leaving.cancel()
    return session


def test_a_rejected_first_turn_moves_to_the_next_credentials_socket_and_cools_the_first(monkeypatch):
    upstreams = {"a": FakeSocket("a", [overloaded("a")]), "b": FakeSocket("b", [good("b")])}
    shared, flow, dialled = world(monkeypatch, ["a", "b"], upstreams)
    client = FakeSocket("client")
    asyncio.run(serve(shared, flow, client, [create()], monkeypatch))
    assert dialled == ["a", "b"]
    texts = client.texts()
    assert any("Hello from b" in t for t in texts), texts
    assert not any("overloaded" in t for t in texts), "the rejected turn's messages must never reach the client"
    assert shared.health.state("a").status == "cooling"
    assert upstreams["a"].close_code == 1000 and upstreams["b"].texts()[0] == create()[0].decode()


def test_a_rejected_later_turn_that_continues_closes_the_client_with_1012(monkeypatch):
    upstreams = {"a": FakeSocket("a", [good("a"), overloaded("a")]), "b": FakeSocket("b")}
    shared, flow, dialled = world(monkeypatch, ["a", "b"], upstreams)
    client = FakeSocket("client")
    client.after_turn = [create(previous_response_id="resp_1")]  # sent once the first turn is answered
    asyncio.run(serve(shared, flow, client, [create()], monkeypatch))
    assert dialled == ["a"], "a continued turn never moves to another socket"
    assert client.close_code == 1012, "Codex reconnects and sends the full request"
    assert shared.health.state("a").status == "cooling"


def test_a_rejected_turn_nobody_else_can_serve_ends_in_a_reconnect_never_the_rejection(monkeypatch):
    upstreams = {"a": FakeSocket("a", [overloaded("a")])}
    shared, flow, _ = world(monkeypatch, ["a"], upstreams, cooldown_wait=0.0)
    client = FakeSocket("client")
    asyncio.run(serve(shared, flow, client, [create()], monkeypatch))
    texts = client.texts()
    assert not any(OVERLOADED["code"] in t for t in texts), texts
    assert client.close_code == 1012, client.close_code


def test_a_turn_overloaded_on_the_only_credential_is_retried_there_after_the_http_backoff(monkeypatch):
    """No pool: the socket's own credential overloaded once. As on HTTP: the same credential again
    after 0.5 s (a new socket, the full create), and the client gets the answer, not the overload."""
    upstreams = {"a": [FakeSocket("a1", [overloaded("a")]), FakeSocket("a2", [good("a")])]}
    shared, flow, dialled = world(monkeypatch, ["a"], upstreams)
    client = FakeSocket("client")
    started = time.monotonic()
    asyncio.run(serve(shared, flow, client, [create()], monkeypatch, quiet=1.0))
    texts = client.texts()
    assert dialled == ["a", "a"], dialled
    assert time.monotonic() - started >= 0.5  # the backoff (the client's 0.2 s quiet wait comes after)
    assert any('"response.completed"' in t for t in texts), texts
    assert not any(OVERLOADED["code"] in t for t in texts), texts


def test_a_continued_turn_on_the_only_credential_is_resent_on_its_socket_after_the_backoff(monkeypatch):
    """A turn that carries previous_response_id cannot leave its socket: with nobody else ready it is
    sent again on the same socket after 0.5 s, never answered with the overload."""
    upstreams = {"a": FakeSocket("a", [overloaded("a"), good("a")])}
    shared, flow, dialled = world(monkeypatch, ["a"], upstreams)
    client = FakeSocket("client")
    started = time.monotonic()
    asyncio.run(serve(shared, flow, client, [create(previous_response_id="resp_1")], monkeypatch, quiet=1.0))
    texts = client.texts()
    assert dialled == ["a"], dialled
    assert time.monotonic() - started >= 0.5  # the backoff (the client's 0.2 s quiet wait comes after)
    assert [t for t in upstreams["a"].texts() if '"response.create"' in t] == [create(previous_response_id="resp_1")[0].decode()] * 2
    assert any('"response.completed"' in t for t in texts), texts
    assert not any(OVERLOADED["code"] in t for t in texts), texts


def test_the_clients_own_key_refused_in_stream_is_its_answer_and_stays_in_rotation(monkeypatch):
    """The client's own key refused (401) in a turn: an error that names no rejection class, so it is
    the client's answer: delivered, never moved to the pool, the key not taken out of rotation."""
    upstreams = {"client": FakeSocket("client-up", [refused("client")]), "a": FakeSocket("a", [good("a")])}
    shared, flow, dialled = world(monkeypatch, ["a"], upstreams, use_client=True)
    client = FakeSocket("client")
    asyncio.run(serve(shared, flow, client, [create()], monkeypatch))
    assert dialled == ["client"], f"the refusal is the client's own answer: {dialled}"
    assert any("invalid_api_key" in t for t in client.texts()), client.texts()
    assert shared.health.state(client_key(CLIENT)).status == "ready"
