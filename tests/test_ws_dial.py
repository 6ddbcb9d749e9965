"""The WebSocket dialer as a shell of the failover loop: what it dials, in which order, what it
writes to the socket's history (its flow comment and its 426's message), and what cools. The
upstream is scripted: `open_upstream` is replaced, so no socket is opened."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque

import pytest
from conftest import Clock
from mitmproxy.http import Headers
from mitmproxy.test import tflow

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.affinity import Affinity
from codex_failover.core.auth import APIKEY, AuthMaterial, auth_from_headers
from codex_failover.core.health import Health
from codex_failover.core.planner import client_key
from codex_failover.core.recovery import Slots
from codex_failover.core.routes import RouteHealth, parse_routes
from codex_failover.core.usage import UsageBook
from codex_failover.core.vocabulary import AMBIGUOUS, HOST_NETWORK, PRE_DISPATCH, TLS_FAILED
from codex_failover.net.socks_bridge import SocksBridges
from codex_failover.rules_file import load_rules
from codex_failover.shared import Shared
from codex_failover.ws import dial as ws_dial, leg as ws_leg
from codex_failover.ws.conn import HandshakeRejected
from codex_failover.ws.upstream import ConnectFailed


@pytest.fixture(autouse=True)
def _own_dial(monkeypatch):
    """The dialer's order, history and outcomes, over the fallback's own dial (`open_upstream`,
    scripted here). The same decisions on mitmproxy's layers: tests/test_ws_layer_socket.py and the
    end-to-end tests."""
    monkeypatch.setenv("CODEX_FAILOVER_FALLBACK", "wsleg")

OVERLOADED = json.dumps({"error": {"type": "service_unavailable_error", "code": "server_is_overloaded",
                                   "message": "busy"}}).encode()
ROUTES = {"corp": ["http://p0:3128", "http://p1:3128"]}
RULES = load_rules()


def cred(name, route="direct"):
    return Credential(name, AuthMaterial(APIKEY, f"tok-{name}"), "https://api.example/v1", "$X", route=route)


class Scripted:
    """`open_upstream` with scripted outcomes by (credential token, endpoint index or None)."""

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.dialled = []

    async def __call__(self, target, fields, via, bridges, tls, connect_timeout, response_timeout, deflate):
        token = {k.lower(): v for k, v in fields}[b"authorization"].decode().removeprefix("Bearer tok-")
        key = token if via is None else f"{token}@{via.index}"
        self.dialled.append(key)
        outcome = self.script[key].pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return Opened(outcome) if isinstance(outcome, str) else outcome


class Opened(str):
    """A scripted socket that opened (named by its script), with what the dialer reads of one."""

    response_headers: list = []
    on_end = None

    def close(self, code=1000, reason=""):
        pass


def dialer(monkeypatch, script, creds, routes=None, use_client=False, **policy):
    clock = Clock()
    health = Health(clock)
    pool = PoolConfig(tuple(creds), Policy(use_client_credential=use_client, **policy), routes=parse_routes(routes))
    affinity = Affinity(clock=clock)
    ctx = Shared(pool, RULES, health, RouteHealth(clock=clock), affinity, UsageBook(), SocksBridges(), relay=None,
                 engine=None, attempts={}, notices=set(), recovery_slots=Slots(), upstream_tls=ssl.create_default_context())
    upstream = Scripted(script)
    upstream.clock = clock
    monkeypatch.setattr(ws_dial, "open_upstream", upstream)
    flow = tflow.tflow()
    flow.request.url = "https://api.example/v1/responses"
    flow.request.headers = Headers(authorization="Bearer tok-client", upgrade="websocket")
    hooks = []

    async def run(leg_flow, *names):  # every addon's hooks on a leg's flow (leg.py), recorded
        hooks.extend((name, leg_flow.request.url, leg_flow.request.headers.get("authorization")) for name in names)

    async def update(leg_flow):
        pass

    monkeypatch.setattr(ws_leg, "_run", run)
    monkeypatch.setattr(ws_leg, "_update", update)
    upstream.hooks = hooks
    return ws_dial.Dialer("w1", flow, ctx, deque()), upstream


def test_endpoints_then_credentials_in_order_with_the_same_history_lines(monkeypatch):
    d, upstream = dialer(monkeypatch, {
        "a@0": [ConnectFailed(PRE_DISPATCH, "refused")],
        "a@1": [ConnectFailed(PRE_DISPATCH, "timed out connecting after 10s")],
        "b": [HandshakeRejected(503, [(b"retry-after", b"7")], OVERLOADED)],
        "c": [HandshakeRejected(404, [], b"not here")],
        "e": ["socket"],
    }, [cred("a", "corp"), cred("b"), cred("c"), cred("e")], ROUTES, max_attempts=5)
    up = asyncio.run(d.open_next())
    assert up is not None, list(d.history)
    assert (up.cand.name, up.route, up.conn) == ("e", "direct", "socket")
    assert upstream.dialled == ["a@0", "a@1", "b", "c", "e"], "the route's endpoints, then the next credentials"
    assert list(d.history) == [
        "a via corp: upgrade failed (route_down HTTP 502): route corp: no endpoint could be used (corp[0] "
        "http://p0:3128: backing off 30s more (failed 1x: refused); corp[1] http://p1:3128: backing off 30s more "
        "(failed 1x: timed out connecting after 10s))",
        "b via direct: upgrade failed (overloaded HTTP 503): busy",
        "c via direct: upgrade failed (upgrade_refused HTTP 404)",
    ]
    health = d.shared.health
    assert health.state("a").status == "ready", "a dead route never cools its credential"
    assert health.state("b").status == "cooling", "an overloaded upgrade cools"
    assert health.recovers_in("b") == 7, "for upstream's Retry-After"
    assert health.state("c").status == "ready", "a refused upgrade says nothing about the credential"
    assert d.last.reason == "upgrade_refused", "the last rejection, for the gate's exhaustion frame"


@pytest.mark.parametrize("failure, line, cooled", [
    (ConnectFailed(TLS_FAILED, "certificate verify failed"), "a via direct: upgrade failed (tls_failed): "
     "certificate verify failed", False),
    (ConnectFailed(HOST_NETWORK, "Name or service not known"), None, False),
    (ConnectFailed(AMBIGUOUS, "reset"), None, True),
    (ConnectionResetError("reset by peer"), None, False),
])
def test_what_a_failed_handshake_does(monkeypatch, failure, line, cooled):
    d, upstream = dialer(monkeypatch, {"a": [failure], "b": ["socket"]}, [cred("a"), cred("b")])
    up = asyncio.run(d.open_next())
    if isinstance(failure, ConnectFailed) and failure.kind == TLS_FAILED:
        assert up is None, "a TLS verification failure fails closed"
        assert upstream.dialled == ["a"], "nothing else is dialled"
        assert list(d.history) == [line]
    else:
        assert up is not None and up.cand.name == "b", f"{failure!r} moves on: {list(d.history)}"
    assert (d.shared.health.state("a").status == "cooling") is cooled, f"a cooled after {failure!r}"


def test_the_clients_own_401_ends_the_dial_and_cools_nothing(monkeypatch):
    d, upstream = dialer(monkeypatch, {"client": [HandshakeRejected(401, [], b'{"error":{"message":"bad key"}}')],
                                       "a": ["socket"]}, [cred("a")], use_client=True)
    assert asyncio.run(d.open_next()) is None, "Codex gets its own 401 on SSE after the 426"
    assert upstream.dialled == ["client"]
    assert list(d.history) == ["client via direct: upgrade failed (auth_rejected HTTP 401): bad key"]
    assert d.shared.health.state(client_key(auth_from_headers(d.headers))).status == "ready"


def test_a_turn_goes_on_from_its_socket_and_stops_at_max_attempts(monkeypatch):
    d, upstream = dialer(monkeypatch, {"b": [HandshakeRejected(503, [], OVERLOADED)], "c": ["socket"]},
                         [cred("a"), cred("b"), cred("c")], max_attempts=2)
    d.new_turn("a")
    assert asyncio.run(d.open_next()) is None, "a's socket and b's upgrade used the turn's two attempts"
    assert upstream.dialled == ["b"]


def test_open_home_dials_only_the_clients_own_credential(monkeypatch):
    d, upstream = dialer(monkeypatch, {"client": ["home socket"]}, [cred("a")], use_client=True)
    d.new_turn("a")
    up = asyncio.run(d.open_home())
    assert up is not None and up.cand.is_client, list(d.history)
    assert upstream.dialled == ["client"]


def test_a_dial_the_client_left_releases_the_endpoint_it_probed(monkeypatch):
    d, upstream = dialer(monkeypatch, {"a@0": [asyncio.CancelledError()]}, [cred("a", "corp")], ROUTES)
    ep = d.shared.pool.routes["corp"][0]
    d.shared.route_health.failed(ep, "refused")
    upstream.clock.now += 30  # due for a probe
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(d.open_next())
    assert d.shared.route_health.describe(ep) == "due for a probe (failed 1x: refused)", "not left claimed"


def test_a_dial_cancelled_when_the_client_left_ends_its_socket_flow(monkeypatch):
    """The client left while a socket was being dialled (the session cancels it): the dial's flow
    ends as killed, with its `error` hook, and is live no more."""
    d, upstream = dialer(monkeypatch, {}, [cred("a")])
    legs = []

    async def hang(target, fields, *args):
        await asyncio.sleep(3600)

    monkeypatch.setattr(ws_dial, "open_upstream", hang)
    real_leg = ws_dial.Leg

    def leg(*args, **kwargs):
        legs.append(real_leg(*args, **kwargs))
        return legs[-1]

    monkeypatch.setattr(ws_dial, "Leg", leg)

    async def run():
        task = asyncio.get_running_loop().create_task(d.open_next())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await legs[0].record.settled()

    asyncio.run(run())
    flow = legs[0].flow
    assert flow.error is not None and flow.error.msg == "Connection killed." and not flow.live
    assert ("error", flow.request.url, "<redacted by codex-failover>") in upstream.hooks
