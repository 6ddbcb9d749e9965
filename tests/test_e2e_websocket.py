"""End to end, `failover_websocket: gate`: a real mitmdump with the addon, the fake upstream's
WebSocket transport, and a WebSocket client through the proxy's CONNECT tunnel."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path

import pytest
from harness import (
    LocalProxies,
    MitmwebProcess,
    ProxyProcess,
    WsClient,
    WsRejected,
    dead_port,
    pool_yaml,
    proxy_status,
    wait_until,
)
from mitmproxy import io

pytestmark = pytest.mark.e2e

RULES_TEMPLATE = Path(__file__).resolve().parents[1] / "rules" / "default.yaml"
PRIMARY, SPARE, THIRD = "sk-test-primary-1", "sk-test-spare-2", "sk-test-third-3"
CREATE = {"type": "response.create", "model": "gpt-fake", "stream": True, "store": False,
          "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
HEADERS = {"authorization": "Bearer sk-test-client-0", "openai-beta": "responses_websockets=2026-02-06",
           "session-id": "thread-1"}


@pytest.fixture
def gated(start_proxy):
    """A proxy with failover_websocket=gate; the pool's own credentials serve unless told otherwise."""
    def start(fake, creds, routes=None, env_extra=None, **policy):
        policy.setdefault("use_client_credential", False)
        return start_proxy(fake, creds, routes, extra=["--set", "failover_websocket=gate"], env_extra=env_extra, **policy)
    return start


# The upstream sockets on mitmproxy's layers (ws/layer_socket.py), and on the fallback's own stack
# (CODEX_FAILOVER_FALLBACK=wsleg, ws/upstream.py) for the cases each path decides differently.
BOTH_STACKS = pytest.mark.parametrize("stack", [None, {"CODEX_FAILOVER_FALLBACK": "wsleg"}], ids=["layers", "own"])


def connect(proxy, fake, headers=HEADERS) -> WsClient:
    client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", headers)
    assert not isinstance(client, WsRejected), client
    return client


def turn(client, body=CREATE, timeout=10.0) -> list[dict]:
    client.send_json(body)
    return client.recv_turn(timeout)


def handshakes(fake) -> list[dict]:
    return [r for r in fake.requests() if r.get("websocket")]


def ws_turns(fake) -> list[dict]:
    return [r for r in fake.requests() if r.get("event") == "ws_turn"]


def text_of(events) -> str:
    return "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")


@BOTH_STACKS
def test_first_turn_overload_moves_to_the_spare_and_the_client_sees_only_the_spare(fake, gated, stack):
    proxy = gated(fake, [("primary", "sk-test-overload-1"), ("spare", SPARE)], env_extra=stack)
    client = connect(proxy, fake)
    events = turn(client)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    assert not any(e["type"] == "error" for e in events)
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # one clean turn, in order
    # The session stays pinned to the spare's socket: the next turn goes there.
    follow = turn(client, {**CREATE, "previous_response_id": events[-1]["response"]["id"], "input": []})
    assert follow[-1]["type"] == "response.completed"
    client.close()
    assert [(r["credential"], r["turn"]) for r in ws_turns(fake)] == [("sk-test-overload-1", 1), (SPARE, 1), (SPARE, 2)]
    assert ws_turns(fake)[2]["scenario"] == "good"  # its previous_response_id was found on the spare's socket


@BOTH_STACKS
def test_later_turn_overload_closes_the_client_and_the_reconnect_is_served_by_a_healthy_credential(fake, gated, stack):
    proxy = gated(fake, [("primary", PRIMARY), ("spare", SPARE)], env_extra=stack)
    client = connect(proxy, fake)
    first = turn(client)
    assert text_of(first).startswith(f"Hello from {PRIMARY}.")
    fake.overload_next(PRIMARY, 1, "overload")
    second = turn(client, {**CREATE, "previous_response_id": first[-1]["response"]["id"], "input": []})
    assert second == [{"type": "__close__", "code": 1012, "reason": "codex-failover: reconnect"}]  # rejection swallowed
    client.close()
    again = connect(proxy, fake)  # what Codex does: a new socket with the full request
    events = turn(again)
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    again.close()
    assert [r["credential"] for r in handshakes(fake)] == [PRIMARY, SPARE]
    status = proxy_status(proxy.port)
    assert {c["name"]: c["state"] for c in status["credentials"]}["primary"] == "cooling"


def test_a_delta_before_the_overload_is_delivered_and_the_turn_ends_in_a_close_codex_retries(fake, gated):
    """Output began, then an overload: nothing is replayed by the proxy (one socket), the delta is the
    client's, the overload is not: the client's socket closes with 1012 and the credential cools, so
    Codex's re-send of the whole request goes elsewhere."""
    proxy = gated(fake, [("primary", "sk-test-delta-overload-1"), ("spare", SPARE)])
    client = connect(proxy, fake)
    events = turn(client)
    client.close()
    assert [e["type"] for e in events] == ["response.created", "response.output_text.delta", "__close__"], events
    assert events[-1]["code"] == 1012
    assert len(handshakes(fake)) == 1
    assert "after the turn's output began" in proxy.log()


def test_a_status_bearing_429_cools_the_credential_and_the_turn_moves(fake, gated):
    proxy = gated(fake, [("primary", PRIMARY), ("spare", SPARE)])
    client = connect(proxy, fake)
    fake.overload_next(PRIMARY, 1, "usage-limit")  # after the handshake: the turn gets the wrapped 429
    events = turn(client)
    assert [(r["credential"], r["scenario"]) for r in ws_turns(fake)] == [(PRIMARY, "usage-limit"), (SPARE, "good")]
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    status = proxy_status(proxy.port)
    client.close()
    primary = {c["name"]: c for c in status["credentials"]}["primary"]
    assert (primary["state"], primary["reason"]) == ("cooling", "usage_limit")
    assert primary["cooling_for_s"] > 60  # the 429's resets_in_seconds, not the default cooldown
    assert primary["usage"] == "primary 100%"  # from the wrapped error's headers


def test_a_dead_route_at_the_handshake_is_answered_426(fake, gated):
    proxies = LocalProxies()
    try:
        refused = proxies.http_proxy("dead", "refuse")
        proxy = gated(fake, [("primary", PRIMARY, "egress")], routes={"egress": [f"http://127.0.0.1:{refused}"]})
        answer = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS)
    finally:
        proxies.close()
    assert isinstance(answer, WsRejected)
    assert answer.status == 426, answer.body[:300]
    assert "route egress" in answer.json()["error"]["message"]
    assert handshakes(fake) == []


def test_an_overloaded_upgrade_goes_to_the_spare_and_without_one_is_answered_426(fake, gated):
    proxy = gated(fake, [("primary", "sk-test-overload-503-1"), ("spare", SPARE)])
    client = connect(proxy, fake)
    assert text_of(turn(client)).startswith(f"Hello from {SPARE}.")
    client.close()
    alone = gated(fake, [("primary", "sk-test-overload-503-9")])
    answer = WsClient.connect(alone.port, f"{fake.base}/v1/responses", HEADERS)
    assert isinstance(answer, WsRejected)
    assert answer.status == 426, answer.body[:300]
    answer = WsClient.connect(alone.port, f"{fake.base}/v1/responses", HEADERS)  # cooling now: not even dialled
    assert isinstance(answer, WsRejected)
    assert answer.status == 426, answer.body[:300]
    assert [r["credential"] for r in handshakes(fake)].count("sk-test-overload-503-9") == 1


def test_exhaustion_ends_in_a_close_codex_retries_never_the_overload(fake, gated):
    """Every credential overloaded: the client socket closes with 1012 (Codex reconnects and re-sends
    in full; the upgrade then answers 426 and the HTTP path answers), never an overload frame."""
    proxy = gated(fake, [("primary", "sk-test-overload-1"), ("spare", "sk-test-overload-2")])
    client = connect(proxy, fake)
    events = turn(client)
    client.close()
    assert events == [{"type": "__close__", "code": 1012, "reason": "codex-failover: reconnect"}], events
    assert [r["credential"] for r in ws_turns(fake)] == ["sk-test-overload-1", "sk-test-overload-2"]


def test_order_and_exactly_once_under_the_hold_with_many_small_messages(tmp_path, gated):
    from harness import FakeUpstreamProcess

    (tmp_path / "many").mkdir()
    fake = FakeUpstreamProcess(tmp_path / "many", "--pace", "0", "--deltas", "2000")
    try:
        proxy = gated(fake, [("primary", "sk-test-many-1")])
        client = connect(proxy, fake)
        for _ in range(3):
            events = turn(client, timeout=30)
            assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [f"d{i} " for i in range(2000)]
            assert [e["type"] for e in events][0] == "response.created"
            assert events[-1]["type"] == "response.completed"
        client.close()
    finally:
        fake.stop()


@pytest.mark.parametrize("max_frames", [48, 100])
def test_a_held_burst_is_delivered_once_in_order_whether_output_or_the_budget_ends_the_hold(tmp_path, gated, max_frames):
    """61 holdable messages then 300 deltas, all in one read: with the default 48-message budget the
    hold ends on the budget, with a 100-message one on the first delta."""
    from harness import FakeUpstreamProcess

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES_TEMPLATE.read_text().replace("max_frames: 48", f"max_frames: {max_frames}"))
    (tmp_path / "held").mkdir()
    fake = FakeUpstreamProcess(tmp_path / "held", "--pace", "0", "--deltas", "300")
    try:
        text, env = pool_yaml(fake.base, [("primary", "sk-test-held-many-1")], use_client_credential=False)
        proxy = ProxyProcess(tmp_path, text, env, extra=["--set", "failover_websocket=gate",
                                                         "--set", f"failover_rules={rules}"])
        try:
            client = connect(proxy, fake)
            for _ in range(2):
                events = turn(client, timeout=30)
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                assert len(events) == 363
            client.close()
            reason = "frame_budget" if max_frames == 48 else "output"
            assert f"verdict=commit reason={reason}" in proxy.log()
        finally:
            proxy.stop()
    finally:
        fake.stop()


def test_pings_are_not_delayed_by_a_held_turn_and_the_status_shows_the_socket(fake, gated):
    proxy = gated(fake, [("primary", "sk-test-stall-1")])
    client = connect(proxy, fake)
    client.send_json(CREATE)
    time.sleep(0.3)  # the turn's response.created is held now (the fake stalls after it)
    client.send_ping(b"still-there")
    assert client.recv(2) == ("pong", b"still-there")
    sockets = proxy_status(proxy.port)["websockets"]
    assert [(s["credential"], s["holding"], s["turns"]) for s in sockets] == [("primary", True, 1)]
    client.close()


def test_a_rejection_followed_by_the_upstream_closing_still_moves_cleanly(fake, gated):
    proxy = gated(fake, [("primary", "sk-test-overload-close-1"), ("spare", SPARE)])
    client = connect(proxy, fake)
    events = turn(client)
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    assert events[-1]["type"] == "response.completed"
    assert turn(client, {**CREATE, "previous_response_id": events[-1]["response"]["id"]})[-1]["type"] == "response.completed"
    client.close()


def test_the_time_budget_releases_a_held_turn_while_the_upstream_is_silent(fake, gated):
    """With the extended hold off (first_event_timeout: 0): released at bootstrap_timeout."""
    proxy = gated(fake, [("primary", "sk-test-stall-1")], bootstrap_timeout="0.3s", first_event_timeout="0s")
    client = connect(proxy, fake)
    client.send_json(CREATE)
    started = time.monotonic()
    got = [client.recv(5), client.recv(5)]
    waited = time.monotonic() - started
    client.close()
    assert [json.loads(text)["type"] for _, text in got] == ["response.created", "response.in_progress"]
    assert 0.25 < waited < 3


def test_a_turn_whose_upstream_goes_silent_moves_at_first_event_timeout(fake, gated):
    """Past bootstrap_timeout with nothing shown the turn is held on; silent for first_event_timeout,
    it moves to the spare (scaled: 0.3 s and 0.5 s stand for 30 s and 60 s)."""
    proxy = gated(fake, [("primary", "sk-test-stall-1"), ("spare", SPARE)], bootstrap_timeout="0.3s",
                  first_event_timeout="0.5s", max_hold="10s")
    client = connect(proxy, fake)
    events = turn(client)
    client.close()
    assert events[-1]["type"] == "response.completed", events
    assert [e["type"] for e in events].count("response.created") == 1, events
    assert [r["credential"] for r in ws_turns(fake)] == ["sk-test-stall-1", SPARE]
    assert "reason=stalled_before_output" in proxy.log()


# -- routes: the gate's own upstream sockets go through each credential's route ---------------------


@pytest.fixture
def proxies():
    local = LocalProxies()
    yield local
    local.close()


@BOTH_STACKS
def test_a_moved_turn_goes_through_the_spares_route_and_proxy_credentials_reach_only_that_proxy(fake, proxies, gated, stack):
    a = proxies.http_proxy("a")
    socks = proxies.socks5("socks", users={"alice": "s3cret"})
    proxy = gated(fake, [("primary", "sk-test-overload-1", "ra"), ("spare", SPARE, "rs")], env_extra=stack,
                  routes={"ra": [f"http://bob:pa%3Ass@127.0.0.1:{a}"], "rs": [f"socks5://alice:s3cret@127.0.0.1:{socks}"]})
    client = connect(proxy, fake)
    assert text_of(turn(client)).startswith(f"Hello from {SPARE}.")
    client.close()
    assert proxies.connections == {"a": 1, "socks": 1}
    assert proxies.proxy_auth["a"] == ["Basic " + base64.b64encode(b"bob:pa:ss").decode()]
    assert all("proxy-authorization" not in r["headers_seen"] for r in handshakes(fake))
    log = proxy.log()
    assert "pa:ss" not in log
    assert "s3cret" not in log
    assert "sk-test-" not in log
    assert "moved to spare via rs[0] socks5://127.0.0.1" in log


def test_a_dead_endpoint_is_skipped_for_the_next_one_of_the_route(fake, proxies, gated):
    alive = proxies.http_proxy("alive")
    silent = proxies.http_proxy("silent", mode="silent")
    proxy = gated(fake, [("primary", PRIMARY, "egress")], connect_timeout="0.5s",
                  routes={"egress": [f"http://127.0.0.1:{dead_port()}", f"http://127.0.0.1:{silent}",
                                     f"http://127.0.0.1:{alive}"]})
    started = time.monotonic()
    client = connect(proxy, fake)
    took = time.monotonic() - started
    assert text_of(turn(client)).startswith(f"Hello from {PRIMARY}.")
    client.close()
    assert proxies.connections["alive"] == 1
    assert took < 3
    endpoints = {r["endpoint"]: r["state"] for r in proxy_status(proxy.port)["routes"]}
    assert [s.split()[0] for s in endpoints.values()] == ["backing", "backing", "up"], endpoints


def test_a_client_leaving_mid_hold_closes_the_upstream_socket_and_leaves_nothing_behind(fake, gated):
    proxy = gated(fake, [("primary", "sk-test-stall-1")])
    client = connect(proxy, fake)
    client.send_json(CREATE)
    deadline = time.monotonic() + 5  # held: the turn reached the fake, which stalls after response.created
    while time.monotonic() < deadline and not [r for r in fake.requests() if r.get("event") == "ws_turn"]:
        time.sleep(0.02)
    client.close(1001)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not [r for r in fake.requests() if r.get("event") == "ws_closed"]:
        time.sleep(0.05)
    closed = [r for r in fake.requests() if r.get("event") == "ws_closed"]
    assert [(r["code"], r["by"]) for r in closed] == [(1001, "client")]  # the client's own close code
    status = proxy_status(proxy.port)
    assert status["websockets"] == []
    assert status["relay_streaming"] == 0
    assert status["relay_unclaimed"] == 0


# -- TLS: the gate's own sockets to an https upstream (wss) ----------------------------------------


@pytest.mark.parametrize("insecure", [True, False])
def test_wss_upstream_verification_follows_mitmproxys_options(tmp_path, proxies, insecure):
    from harness import FakeUpstreamProcess

    tls_fake = FakeUpstreamProcess(tmp_path, "--tls", "--pace", "0.002", "--deltas", "4")
    base = f"https://127.0.0.1:{tls_fake.port}"
    alive = proxies.http_proxy("alive")
    text, env = pool_yaml(base, [("primary", "sk-test-overload-1"), ("spare", SPARE, "egress")],
                          {"egress": [f"http://127.0.0.1:{alive}"]}, use_client_credential=False)
    extra = ["--set", "failover_websocket=gate"] + (["--set", "ssl_insecure=true"] if insecure else [])
    proxy = ProxyProcess(tmp_path, text, env, extra=extra)
    try:
        # The client speaks plain ws inside its tunnel; the gate dials the pool's https base_url itself.
        answer = WsClient.connect(proxy.port, f"http://127.0.0.1:{tls_fake.port}/v1/responses", HEADERS)
        if insecure:  # moved from the direct primary to the spare, whose TLS runs inside its proxy's tunnel
            assert text_of(turn(answer)).startswith(f"Hello from {SPARE}.")
            answer.close()
            assert proxies.connections["alive"] == 1
        else:  # a certificate that does not verify fails closed: no other credential, 426
            assert isinstance(answer, WsRejected)
            assert answer.status == 426, answer.body[:300]
            assert "certificate" in answer.json()["error"]["message"].lower()
            assert handshakes(tls_fake) == []
            assert proxies.connections["alive"] == 0
    finally:
        proxy.stop()
        tls_fake.stop()


def test_the_clients_own_credential_is_tried_first_and_its_overload_moves_the_turn(fake, gated):
    proxy = gated(fake, [("spare", SPARE)], use_client_credential=True)
    client = connect(proxy, fake, {**HEADERS, "authorization": "Bearer sk-test-client-overload"})
    events = turn(client)
    client.close()
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    assert [r["credential"] for r in handshakes(fake)] == ["sk-test-client-overload", SPARE]
    assert "credential=client" in proxy.log(), proxy.log()[-2000:]
    assert "sk-test-" not in proxy.log()


# -- replay safety on a spare's socket, and bounds ----------------------------------------------------

REASONING = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-from-the-client-account"}
COMPACTION = {"type": "compaction", "encrypted_content": "gAAAA-compacted-by-the-client-account"}


def test_a_spares_socket_never_gets_another_accounts_encrypted_reasoning(fake, gated):
    proxy = gated(fake, [("spare", SPARE)])  # the socket opens on the spare: it is not the client's account
    client = connect(proxy, fake)
    events = turn(client, {**CREATE, "input": [*CREATE["input"], REASONING]})
    client.close()
    assert text_of(events).startswith(f"Hello from {SPARE}.")
    assert [(r["credential"], r["input_items"], r["encrypted_reasoning"]) for r in ws_turns(fake)] == [(SPARE, 2, 0)]


def test_a_turn_bound_to_the_clients_account_goes_home_from_a_spares_socket(fake, gated):
    proxy = gated(fake, [("spare", SPARE)])
    client = connect(proxy, fake, {**HEADERS, "authorization": "Bearer sk-test-client-good"})
    events = turn(client, {**CREATE, "input": [COMPACTION, *CREATE["input"]]})
    client.close()
    assert text_of(events).startswith("Hello from sk-test-client-good.")
    assert [(r["credential"], r["compaction"]) for r in ws_turns(fake)] == [("sk-test-client-good", True)]
    assert "goes to the credential holding its state" in proxy.log()


def test_a_turn_carrying_the_spares_own_compaction_stays_on_the_spares_socket(fake, gated):
    """After a failover the session's compaction is made by the spare: the turn carrying it stays
    there (the fake refuses another account's compaction; before, it went 'home' to the client)."""
    proxy = gated(fake, [("spare", SPARE)])
    client = connect(proxy, fake, {**HEADERS, "authorization": "Bearer sk-test-client-good"})
    compacted = turn(client, {**CREATE, "input": [*CREATE["input"], {"type": "compaction_trigger"}]})
    item = next(e["item"] for e in compacted if e["type"] == "response.output_item.done")
    assert item["type"] == "compaction"
    events = turn(client, {**CREATE, "input": [item, *CREATE["input"]]})
    client.close()
    assert text_of(events).startswith(f"Hello from {SPARE}."), events
    assert [(r["credential"], r["compaction"], r["scenario"]) for r in ws_turns(fake)] == [
        (SPARE, False, "good"), (SPARE, True, "good")]
    assert "goes to the credential holding its state" not in proxy.log()


def test_a_client_leaving_mid_hold_never_sends_its_turn_to_a_spare(fake, gated):
    proxy = gated(fake, [("primary", "sk-test-stall-1"), ("spare", SPARE)])
    client = connect(proxy, fake)
    client.send_json(CREATE)
    time.sleep(0.3)
    client.close(1001)
    time.sleep(1.0)
    assert [r["credential"] for r in handshakes(fake)] == ["sk-test-stall-1"]
    assert "verdict=failover" not in proxy.log()
    assert "moved" not in proxy.log()


def test_the_clients_own_401_at_the_upgrade_is_left_to_codex_on_sse(fake, gated):
    from harness import post_responses

    proxy = gated(fake, [("spare", SPARE)], use_client_credential=True)
    answer = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", {"authorization": "Bearer sk-test-me-unauthorized"})
    assert isinstance(answer, WsRejected)
    assert answer.status == 426, answer.body[:300]
    reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-me-unauthorized")
    assert reply.status == 401  # still the client's own answer: its credential was not taken out of rotation
    assert [r["credential"] for r in handshakes(fake)] == ["sk-test-me-unauthorized"]


def test_max_attempts_bounds_one_turns_sockets(fake, gated):
    proxy = gated(fake, [("a", "sk-test-a-overload"), ("b", "sk-test-b-overload"), ("c", "sk-test-c-overload"),
                         ("d", "sk-test-d-good")], max_attempts=2)
    client = connect(proxy, fake)
    events = turn(client)
    client.close()
    assert events == [{"type": "__close__", "code": 1012, "reason": "codex-failover: reconnect"}], events
    assert [r["credential"] for r in ws_turns(fake)] == ["sk-test-a-overload", "sk-test-b-overload"]


def test_a_turn_bound_to_the_clients_account_fails_with_503_when_that_account_cannot_serve(fake, gated):
    proxy = gated(fake, [("spare", SPARE)])
    client = connect(proxy, fake, {**HEADERS, "authorization": "Bearer sk-test-client-overload-503"})
    events = turn(client, {**CREATE, "input": [COMPACTION, *CREATE["input"]]})
    follow = turn(client)  # the socket (still on the spare) goes on serving other turns
    client.close()
    assert [(e["type"], e["status"], e["error"]["code"]) for e in events] == [("error", 503, "no_usable_credential")]
    assert text_of(follow).startswith(f"Hello from {SPARE}.")
    assert [r["credential"] for r in ws_turns(fake)] == [SPARE]  # the bound turn reached no account


REDIRECT = '''from mitmproxy import http

def request(flow: http.HTTPFlow) -> None:  # a user's map_remote-style script, loaded after the addon
    if flow.request.host == "codex-upstream.invalid":
        flow.request.host = "127.0.0.1"
'''


def test_another_addon_sending_the_model_host_elsewhere_decides_where_each_socket_goes(fake, tmp_path):
    """Each upstream socket is a flow every addon's hooks see (ws/leg.py): a script loaded after the
    addon that redirects the model host sends the gate's own upgrades there too. Before, the gate
    dialled the name itself, failed to resolve it for every credential and answered 426."""
    script = tmp_path / "redirect.py"
    script.write_text(REDIRECT)
    text, env = pool_yaml(f"http://codex-upstream.invalid:{fake.port}", [("spare", SPARE)], use_client_credential=True)
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", "failover_websocket=gate", "-s", str(script),
                                                               "--set", "connection_strategy=lazy"])
    try:
        client = WsClient.connect(proxy.port, f"http://codex-upstream.invalid:{fake.port}/v1/responses", HEADERS)
        assert not isinstance(client, WsRejected), (client, proxy.log())
        events = turn(client)
        client.close()
    finally:
        proxy.stop()
    assert text_of(events).startswith("Hello from sk-test-client-0."), events
    assert [h["credential"] for h in handshakes(fake)] == ["sk-test-client-0"]  # no spare was needed
    assert "turn 1 credential=client route=direct" in proxy.log() and "upgrade failed" not in proxy.log(), proxy.log()


def test_each_socket_is_a_saved_flow_with_its_messages_and_verdict_and_no_secret(fake, start_proxy, tmp_path):
    """`-w` saves every upstream socket of a gated session as a WebSocket flow: the rejected turn's
    socket with the create and the rejection it received, marked rejected; the spare's with the turn
    it served. Neither holds a credential."""
    saved = tmp_path / "flows.mitm"
    primary, spare = "sk-proj-PRIMARYSECRET1-overload", "sk-proj-SPARESECRET2"
    proxy = start_proxy(fake, [("primary", primary), ("spare", spare)],
                        extra=["--set", "failover_websocket=gate", "-w", str(saved)], use_client_credential=False)
    client = connect(proxy, fake, {**HEADERS, "authorization": "Bearer sk-proj-CLIENTSECRET3"})
    events = turn(client)
    assert events[-1]["type"] == "response.completed", events
    client.close()
    wait_until(lambda: proxy_status(proxy.port)["websockets"] == [], 10)
    os.kill(proxy.proc.pid, signal.SIGINT)
    proxy.proc.wait(timeout=15)
    data = saved.read_bytes()
    for secret in (primary, spare, "sk-proj-CLIENTSECRET3"):
        assert secret.encode() not in data, f"{secret} leaked"
    with open(saved, "rb") as fh:
        legs = [f for f in io.FlowReader(fh).stream() if f.is_replay and f.websocket is not None]
    assert [f.marked for f in legs] == [":x:", ":white_check_mark:"], [(f.marked, f.comment) for f in legs]
    rejected, served = legs
    assert "turn 1: primary via direct: failover (overloaded)" in rejected.comment, rejected.comment
    assert rejected.request.headers["authorization"] == "<redacted by codex-failover>"
    sent = [m for m in rejected.websocket.messages if m.from_client]
    assert json.loads(sent[0].content)["type"] == "response.create"
    assert any(b"server_is_overloaded" in m.content for m in rejected.websocket.messages if not m.from_client)
    assert rejected.websocket.close_code == 1000 and rejected.websocket.closed_by_client
    assert "turn 1: spare via direct: commit (output)" in served.comment, served.comment
    assert any(b"response.completed" in m.content for m in served.websocket.messages if not m.from_client)
    assert "Traceback" not in proxy.log()


def test_mitmweb_shows_each_socket_of_a_moved_turn_with_its_verdict_and_no_secret(fake, tmp_path):
    primary, spare = "sk-proj-PRIMARYSECRET1-overload", "sk-proj-SPARESECRET2"
    text, env = pool_yaml(fake.base, [("primary", primary), ("spare", spare)], use_client_credential=False)
    web = MitmwebProcess(tmp_path / "web", text, env, extra=["--set", "failover_websocket=gate"])
    try:
        client = connect(web, fake, {**HEADERS, "authorization": "Bearer sk-proj-CLIENTSECRET3"})
        assert turn(client)[-1]["type"] == "response.completed"
        legs = wait_until(lambda: (lambda ls: ls if len(ls) == 2 and all(f["marked"] for f in ls) else None)(
            [f for f in web.api("/flows") if f["is_replay"]]), 10, what="two marked sockets")
        rejected, served = legs
        assert (rejected["marked"], served["marked"]) == ("❌", "✅"), legs
        assert "turn 1: primary via direct: failover (overloaded)" in rejected["comment"]
        assert "turn 1: spare via direct: commit (output)" in served["comment"]
        assert rejected["websocket"] is not None and served["websocket"] is not None
        client.close()
        wait_until(lambda: all(f["websocket"]["close_code"] for f in web.api("/flows") if f["is_replay"]), 10,
                   what="both sockets ended")
        dump = web.api("/flows/dump", raw=True)
        for secret in (primary, spare, "sk-proj-CLIENTSECRET3"):
            assert secret.encode() not in dump + str(web.api("/flows")).encode(), f"{secret} leaked"
        assert b"server_is_overloaded" in dump  # the rejection the primary's socket received
    finally:
        web.stop()
