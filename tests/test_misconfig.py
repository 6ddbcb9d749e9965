"""Say what is wrong (issue 46 item 4): a misspelt option, a pool of the other kind, a missing proxy
token. Unit rows, then each end to end: one line each."""

from __future__ import annotations

import base64
import json
import time

import pytest
from harness import ProxyProcess, pool_yaml, post_responses, request, wait_until

from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.policy import Credential, Policy, PoolConfig
from codex_failover.core.pool_reach import kind_gap, kinds_at_start
from codex_failover.options import unknown_options

KNOWN = ["failover_config", "failover_rules", "failover_clients", "listen_host", "mode"]


@pytest.mark.parametrize("deferred,lines", [
    ({}, []),
    ({"failover_conf": "x"}, ["unknown option failover_conf (--set failover_conf=...) is ignored; did you mean "
                              "failover_config?"]),
    ({"falover_rules": "x"}, ["unknown option falover_rules (--set falover_rules=...) is ignored; did you mean "
                              "failover_rules?"]),
    ({"failover_zzzzzzzzzz": "x"}, ["unknown option failover_zzzzzzzzzz (--set failover_zzzzzzzzzz=...) is ignored; "
                                    "the addon's options are failover_clients, failover_config, failover_rules"]),
    ({"some_other_addons_option": "x"}, []),  # another script's, not ours to judge
])
def test_unknown_options(deferred, lines):
    assert unknown_options(deferred, KNOWN) == lines


def test_unknown_option_never_shows_its_value():
    (line,) = unknown_options({"failover_conf": "sk-secret-value"}, KNOWN)
    assert "sk-secret" not in line


def _cred(name, kind):
    auth = AuthMaterial(kind, f"tok-{name}", account_id=f"acct-{name}" if kind == CHATGPT else None)
    return Credential(name, auth, "https://x", name)


def test_kind_gap_and_the_start_line():
    keys = PoolConfig((_cred("k1", APIKEY), _cred("k2", APIKEY)))
    chatgpt_client = AuthMaterial(CHATGPT, "tok-client", account_id="acct-client")
    gap = kind_gap(chatgpt_client, keys)
    assert gap and "API-key" in gap and "ChatGPT-login request" in gap and "cross_kind" in gap
    assert kind_gap(AuthMaterial(APIKEY, "sk-client"), keys) is None
    assert kind_gap(chatgpt_client, PoolConfig(keys.credentials, Policy(cross_kind=True))) is None
    assert kind_gap(chatgpt_client, PoolConfig()) is None
    line = kinds_at_start(keys)
    assert line and "API-key" in line and "ChatGPT-login" in line and "cross_kind" in line
    assert kinds_at_start(PoolConfig((_cred("k1", APIKEY), _cred("c", CHATGPT)))) is None
    assert kinds_at_start(PoolConfig(keys.credentials, Policy(cross_kind=True))) is None


# -- end to end -------------------------------------------------------------------------------------

def _lines(proxy, needle):
    return [x for x in proxy.log().splitlines() if needle in x]


@pytest.mark.e2e
def test_a_misspelt_option_is_one_warning_naming_the_real_one(tmp_path):
    proxy = ProxyProcess(tmp_path, None, extra=["--set", f"failover_conf={tmp_path / 'pool.yaml'}"])
    try:
        wait_until(lambda: "local clients" in proxy.log(), 10, "the start-up lines")
        (line,) = _lines(proxy, "unknown option")
        assert "failover_conf" in line and "did you mean failover_config?" in line
    finally:
        proxy.stop()


def _jwt(claims):
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


@pytest.mark.e2e
def test_a_pool_of_the_other_kind_says_so_at_start_and_when_it_cannot_serve(fake, tmp_path):
    text, env = pool_yaml(fake.base, [("k1", "sk-test-k1-good")], cooldown_wait="0")
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        wait_until(lambda: "local clients" in proxy.log(), 10, "the start-up lines")
        (line,) = _lines(proxy, "cross_kind")
        assert "every pooled credential is API-key" in line
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", _jwt({"exp": time.time() + 60}),
                               headers={"chatgpt-account-id": "acct-client-overload"})
        assert reply.status != 200
        wait_until(lambda: len(_lines(proxy, "cross_kind")) == 2, 5, "the exhausted line")
        line = _lines(proxy, "cross_kind")[1]
        assert "exhausted" in line and "the pool has only API-key credentials" in line
    finally:
        proxy.stop()


@pytest.mark.e2e
def test_the_first_407_per_client_address_is_one_line(fake, tmp_path):
    proxy = ProxyProcess(tmp_path, None, extra=["--proxyauth", "user:PROXY-SECRET-9"])
    try:
        for _ in range(3):
            answer = request(proxy.port, "GET", f"{fake.base}/v1/models")
            assert answer.status == 407
        wait_until(lambda: _lines(proxy, "407 Proxy"), 5, "the 407 line")
        time.sleep(0.2)
        (line,) = _lines(proxy, "407 Proxy")
        assert "client 127.0.0.1" in line and "sent no proxy credentials" in line
        assert "PROXY-SECRET-9" not in proxy.log()
    finally:
        proxy.stop()


@pytest.mark.e2e
def test_a_gated_turn_of_the_other_kind_says_cross_kind_when_nothing_can_serve_it(fake, tmp_path):
    from harness import WsClient

    text, env = pool_yaml(fake.base, [("k1", "sk-test-k1-good")], cooldown_wait="0")
    proxy = ProxyProcess(tmp_path, text, env, extra=["--set", "failover_websocket=gate"])
    try:
        client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", {
            "authorization": f"Bearer {_jwt({'exp': time.time() + 60})}", "chatgpt-account-id": "acct-client-overload",
            "openai-beta": "responses_websockets=2026-02-06", "session-id": "thread-1"})
        client.send_json({"type": "response.create", "model": "gpt-fake", "stream": True, "store": False,
                          "input": [{"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": "hi"}]}]})
        events = client.recv_turn(10)
        client.close()
        assert events[-1] == {"type": "__close__", "code": 1012, "reason": "codex-failover: reconnect"}, events
        line = wait_until(lambda: _lines(proxy, "no other credential can serve turn"), 5, "the gate's line")[0]
        assert "the pool has only API-key credentials" in line and "cross_kind" in line
    finally:
        proxy.stop()
