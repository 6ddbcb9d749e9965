"""End to end, one proxy for the module: the shapes of round two (tests/fixtures/wire/shapes) through a
real mitmdump with the addon. Each test's client key is the first credential (the fake answers the
shape for it: the scenario is in the key), the pool's `spare` serves; a second request shows what the
first answer did to the first credential: left in rotation (the route's refusals), out of rotation or
resting (the account's), skipped for that model only (the model's)."""

from __future__ import annotations

import pytest
from harness import FakeUpstreamProcess, ProxyProcess, WsClient, WsRejected, pool_yaml, post_responses

pytestmark = pytest.mark.e2e

SPARE = "sk-test-spare-good"
PRO = "gpt-pro-fake"  # the model the `no-pro-model` credential's plan lacks (fake_upstream.PRO_MODEL)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shapes2")
    fake = FakeUpstreamProcess(tmp / "fake", "--pace", "0.002", "--deltas", "4", "--stall", "30")
    text, env = pool_yaml(fake.base, [("spare", SPARE)], use_client_credential=True)
    proxy = ProxyProcess(tmp / "proxy", text, env, extra=["--set", "failover_websocket=gate"])
    yield fake, proxy
    proxy.stop()
    fake.stop()


def url(fake) -> str:
    return f"{fake.base}/v1/responses"


def ask(fake, proxy, key: str, model: str = "gpt-fake"):
    body = {"model": model, "stream": True, "input": [], "store": False}
    reply = post_responses(proxy.port, url(fake), key, body)
    assert reply.status == 200, reply.body[:300]
    kinds = [e["type"] for e in reply.events()]
    assert "error" not in kinds and "response.failed" not in kinds and kinds[-1] == "response.completed"
    return reply


def served_by(reply) -> str:
    return next(name for name in (SPARE, "sk-test-first") if f"Hello from {name}" in reply.body.decode())


def before(fake, key: str) -> int:
    return sum(1 for r in fake.model_requests() if r.get("credential") == key)


@pytest.mark.parametrize("scenario,reason,stays", [
    ("deactivated-402", "account_disabled", False),  # out of rotation
    ("not-included-429", "account_disabled", False),
    ("workspace-cap-429", "workspace_limit", False),  # a long rest
    ("cf-challenge-403", "edge_blocked", True),  # the route's: the credential stays in rotation
    ("cf-blocked-403", "edge_blocked", True),
    ("region-403", "edge_blocked", True),
    ("empty-403", "forbidden_page", True),  # no sign of the edge: nothing backs off
    ("capacity-top", "capacity", False),  # resting a moment for capacity
    ("model-404", "model_not_entitled", True),  # (for another model: asked again)
    ("model-param-404", "model_not_entitled", True),
])
def test_the_first_answers_the_shape_and_the_spare_serves(world, scenario, reason, stays):
    fake, proxy = world
    key = f"sk-test-first-{scenario}"
    first, spare = before(fake, key), before(fake, SPARE)
    reply = ask(fake, proxy, key)
    assert served_by(reply) == SPARE
    assert (before(fake, key), before(fake, SPARE)) == (first + 1, spare + 1)
    assert f"reason={reason}" in proxy.log()
    # The next request for another model: the first credential is asked again only if it stayed.
    seen = before(fake, key)
    ask(fake, proxy, key, "gpt-other")
    assert before(fake, key) == seen + (1 if stays else 0), f"{scenario}: in rotation should be {stays}"


def test_the_model_row_skips_the_credential_for_that_model_only(world):
    fake, proxy = world
    key = "sk-test-first-no-pro-model"

    def counts():
        return before(fake, key), before(fake, SPARE)

    start = counts()
    assert served_by(ask(fake, proxy, key, PRO)) == SPARE
    assert counts() == (start[0] + 1, start[1] + 1)  # the first said it lacks the model, the spare served
    assert served_by(ask(fake, proxy, key, PRO)) == SPARE
    assert counts() == (start[0] + 1, start[1] + 2)  # skipped for that model without dialling
    reply = ask(fake, proxy, key, "gpt-fake")  # another model: the first credential serves it
    assert f"Hello from {key}" in reply.body.decode()
    assert counts() == (start[0] + 2, start[1] + 2)
    assert "not entitled to model gpt-pro-fake" in proxy.log()


def test_a_real_400_reaches_the_client_and_the_spare_is_never_asked(world):
    fake, proxy = world
    key = "sk-test-first-invalid"
    spare_before = before(fake, SPARE)
    reply = post_responses(proxy.port, url(fake), key)
    assert reply.status == 400 and reply.json()["error"]["code"] == "invalid_value"
    assert before(fake, key) == 1 and before(fake, SPARE) == spare_before


def test_the_attestation_goes_only_to_its_own_account(world):
    """x-oai-attestation (the Desktop app's) does not pin the request: it moves, without the header."""
    fake, proxy = world
    key = "sk-test-first-overload-503"
    reply = post_responses(proxy.port, url(fake), key, headers={"x-oai-attestation": '{"v":1,"s":0,"t":"v1.opaque"}'})
    assert reply.status == 200 and f"Hello from {SPARE}" in reply.body.decode()
    mine = [r for r in fake.model_requests() if r.get("credential") in (key, SPARE)][-2:]
    assert [(r["credential"], r["attestation"]) for r in mine] == [(key, True), (SPARE, False)]


# -- the WebSocket gate -----------------------------------------------------------------------------------

HELLO = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]


def connect(fake, proxy, key: str, session: str = "") -> WsClient:
    headers = {"authorization": f"Bearer {key}", "openai-beta": "responses_websockets=2026-02-06",
               "session-id": session or key}
    client = WsClient.connect(proxy.port, url(fake), headers)
    assert not isinstance(client, WsRejected), client
    return client


def create(**extra) -> dict:
    return {"type": "response.create", "model": "gpt-fake", "stream": True, "store": False, "input": HELLO, **extra}


def text_of(events: list[dict]) -> str:
    return "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")


def test_a_websocket_error_with_status_code_moves_the_turn(world):
    fake, proxy = world
    key = "sk-test-first-status-code-503"
    client = connect(fake, proxy, key)
    try:
        client.send_json(create())
        events = client.recv_turn(10.0)
    finally:
        client.close()
    assert events[-1]["type"] == "response.completed", events
    assert not any(e["type"] == "error" for e in events)
    assert f"Hello from {SPARE}" in text_of(events)


def test_an_empty_403_on_the_upgrade_moves_the_socket_and_keeps_the_credential(world):
    fake, proxy = world
    key = "sk-test-first-empty-403"
    for n in range(2):  # a new session's upgrade is tried on the first credential again: still in rotation
        client = connect(fake, proxy, key, f"{key}-{n}")
        try:
            client.send_json(create())
            events = client.recv_turn(10.0)
        finally:
            client.close()
        assert events[-1]["type"] == "response.completed" and f"Hello from {SPARE}" in text_of(events)
    upgrades = [r for r in fake.requests() if r.get("method") == "GET" and r.get("credential") == key]
    assert len(upgrades) == 2


def test_previous_response_not_found_after_a_move_tells_codex_to_reconnect(world):
    """Turn 1 is served on the first credential's socket; turn 2 is overloaded there and moves to the
    spare's socket; turn 3 names turn 1's response, which the spare's socket does not hold. Codex is told
    to reconnect (1012), never handed the error; its re-send, whole, is served."""
    fake, proxy = world
    key = "sk-test-first-ws-state"
    client = connect(fake, proxy, key)
    try:
        client.send_json(create())
        first = client.recv_turn(10.0)
        assert first[-1]["type"] == "response.completed" and f"Hello from {key}" in text_of(first)
        r1 = first[-1]["response"]["id"]
        fake.overload_next(key)
        client.send_json(create())
        second = client.recv_turn(10.0)
        assert second[-1]["type"] == "response.completed" and f"Hello from {SPARE}" in text_of(second)
        client.send_json(create(previous_response_id=r1, input=[]))
        third = client.recv_turn(10.0)
    finally:
        client.close()
    assert [e["type"] for e in third] == ["__close__"] and third[0]["code"] == 1012, third
    assert "previous_response_not_found" not in str(third)
    again = connect(fake, proxy, key)  # Codex's reconnect: the full input, no previous_response_id
    try:
        again.send_json(create())
        events = again.recv_turn(10.0)
    finally:
        again.close()
    assert events[-1]["type"] == "response.completed"
    assert "reason=state_lost" in proxy.log()


def test_a_websocket_turn_for_a_model_the_account_lacks_moves_and_is_remembered(world):
    fake, proxy = world
    key = "sk-test-first-no-pro-model-ws"
    client = connect(fake, proxy, key)
    try:
        client.send_json(create(model=PRO))
        events = client.recv_turn(10.0)
    finally:
        client.close()
    assert events[-1]["type"] == "response.completed" and f"Hello from {SPARE}" in text_of(events)
    seen = before(fake, key)
    assert served_by(ask(fake, proxy, key, PRO)) == SPARE  # the next request for that model skips it
    assert before(fake, key) == seen


# -- one account's edge answer on a shared route; the client's own region 403 ------------------------------

@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """Two pooled API keys behind one egress proxy (one gets the edge's block page), and a pooled ChatGPT
    login behind the edge too; cooldown_wait 0 so nothing is held."""
    import json
    import os
    import time

    from fake_oauth import access_token, auth_json
    from harness import LocalProxies

    tmp = tmp_path_factory.mktemp("shapes2-routed")
    fake = FakeUpstreamProcess(tmp / "fake", "--pace", "0.002", "--deltas", "4", "--stall", "30")
    egress = LocalProxies().http_proxy("corp")
    folder = tmp / "spare-cf"
    folder.mkdir()
    auth = folder / "auth.json"
    account = "acct-spare-cf-blocked-403"
    auth.write_text(json.dumps(auth_json(account, access_token(account, 0), "rt-x", time.time())))
    os.chmod(auth, 0o600)
    text = (f"routes:\n  corp: [\"http://127.0.0.1:{egress}\"]\n"
            "credentials:\n"
            f"  - name: blocked\n    api_key_env: KEY_BLOCKED\n    base_url: {fake.base}/v1\n    route: corp\n"
            f"  - name: healthy\n    api_key_env: KEY_HEALTHY\n    base_url: {fake.base}/v1\n    route: corp\n"
            f"  - name: spare-cf\n    auth_file: {auth}\n    base_url: {fake.base}/v1\n"
            "policy:\n  cooldown_wait: 0\n  max_attempts: 4\n  bootstrap_timeout: 5s\n")
    env = {"KEY_BLOCKED": "sk-test-b-cf-blocked-403", "KEY_HEALTHY": "sk-test-work-good"}
    proxy = ProxyProcess(tmp / "proxy", text, env, extra=["--set", "failover_token_refresh=false"])
    yield fake, proxy
    proxy.stop()
    fake.stop()


def test_one_accounts_edge_403_does_not_take_the_shared_route_down(routed):
    """The edge's block page to one account backs off that account on the endpoint only: the other
    account behind the same egress serves every request, and the blocked one is not asked again."""
    fake, proxy = routed
    client = "sk-test-client-usage-limit"  # the client's own rests (429), so the pool serves
    for _ in range(3):
        reply = post_responses(proxy.port, url(fake), client)
        assert reply.status == 200 and "Hello from sk-test-work-good" in reply.body.decode(), reply.body[:300]
    assert before(fake, "sk-test-b-cf-blocked-403") == 1, "the blocked account is not dialled again in its episode"
    log = proxy.log()
    assert "the edge refused credential blocked" in log and "not dialled again for" not in log


def test_the_clients_own_region_403_comes_as_it_came_when_nothing_serves(routed):
    """The client's own answer says its region is not served; the only pooled login of its kind meets the
    edge's block page too: the client gets the service's own 403, not an answer of ours."""
    from fake_oauth import access_token

    fake, proxy = routed
    account = "acct-own-region-403"
    reply = post_responses(proxy.port, url(fake), access_token(account, 0), headers={"chatgpt-account-id": account})
    assert reply.status == 403, reply.body[:300]
    assert reply.json()["error"]["code"] == "unsupported_country_region_territory"
    assert [r["credential"] for r in fake.model_requests()][-2:] == [account, "acct-spare-cf-blocked-403"]
    assert "the upstream's answer as it came" in proxy.log()


def test_a_model_nobody_served_is_not_sent_to_every_account(routed, tmp_path):
    """A model no credential was seen serving (a typo, or a plan nobody in the pool has): the client's
    own account lacks it, one pooled account is asked, then the client gets the service's own 400."""
    fake, _ = routed
    names = ("np1", "np2", "np3")
    text, env = pool_yaml(fake.base, [(n, f"sk-test-{n}-no-pro-model") for n in names], cooldown_wait=0)
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        own = "sk-test-own-no-pro-model"
        body = {"model": PRO, "stream": True, "input": [], "store": False}
        reply = post_responses(proxy.port, url(fake), own, body)
        assert reply.status == 400, reply.body[:300]
        assert "model is not supported when using Codex" in reply.json()["detail"], "the service's answer as it came"
        asked = [r["credential"] for r in fake.model_requests() if r.get("model") == PRO]
        assert asked[-2:] == [own, "sk-test-np1-no-pro-model"] and "sk-test-np2-no-pro-model" not in asked
    finally:
        proxy.stop()
