"""Health, planning, synchronous-error taxonomy, cooldowns, transport failures, endpoints."""

import json

import pytest
from conftest import WIRE, Clock

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.codex_request import EndpointMatcher, asks_to_stream, parse_body, swap_credential
from codex_failover.core.health import Health
from codex_failover.core.planner import make_plan
from codex_failover.core.taxonomy import classify_response, cooldown_seconds, exhausted_status, retry_after_seconds
from codex_failover.core.transport import classify_connection_error
from codex_failover.core.vocabulary import AMBIGUOUS, HOST_NETWORK, PRE_DISPATCH, TLS_FAILED


def cred(name, kind=APIKEY, token=None):
    auth = AuthMaterial(kind, token or f"tok-{name}", account_id="acct" if kind == CHATGPT else None)
    return Credential(name, auth, "https://api.example/v1", "$X")


# -- health ---------------------------------------------------------------------------------

def test_health_cooling_expires_with_the_clock():
    clock = Clock()
    health = Health(clock)
    health.cool("a", 30, "overloaded")
    assert health.state("a").status == "cooling"
    assert health.recovers_in("a") == 30
    health.cool("a", 10, "overloaded")  # never shortened
    assert health.recovers_in("a") == 30
    clock.now += 30
    assert health.ready("a")
    assert health.recovers_in("a") == 0


def test_health_out_of_rotation_until_restored():
    health = Health(Clock())
    health.take_out("a", "401")
    assert health.state("a").status == "out"
    assert health.recovers_in("a") is None
    health.restore("a")
    assert health.ready("a")


# -- planning -------------------------------------------------------------------------------

def test_plan_client_first_then_same_kind_pool():
    pool = PoolConfig((cred("k1"), cred("c1", CHATGPT), cred("k2")), Policy())
    plan = make_plan(AuthMaterial(APIKEY, "client"), pool, Health(Clock()))
    assert [c.name for c in plan.candidates] == ["client", "k1", "k2"]
    assert plan.candidates[0].is_client
    assert plan.candidates[0].auth is None


def test_plan_cross_kind_and_without_client():
    pool = PoolConfig((cred("k1"), cred("c1", CHATGPT)), Policy(use_client_credential=False, cross_kind=True))
    plan = make_plan(AuthMaterial(APIKEY, "client"), pool, Health(Clock()))
    assert [c.name for c in plan.candidates] == ["k1", "c1"]


def test_plan_skips_cooling_and_out_caps_attempts_and_dedupes_the_client():
    clock = Clock()
    health = Health(clock)
    pool = PoolConfig(tuple(cred(f"k{i}") for i in range(6)), Policy(max_attempts=3))
    health.cool("k1", 60, "overloaded")
    health.take_out("k2", "401")
    plan = make_plan(AuthMaterial(APIKEY, "tok-k0"), pool, health)  # the client's key is pooled as k0
    assert [c.name for c in plan.candidates] == ["k0", "k3", "k4"]
    assert plan.candidates[0].is_client
    assert plan.candidates[0].auth is None
    assert [(c.name, why) for c, why in plan.skipped] == [("k1", "cooling"), ("k2", "out")]


def test_no_pool_uses_the_client_even_if_told_not_to():
    plan = make_plan(AuthMaterial(APIKEY, "c"), PoolConfig((), Policy(use_client_credential=False)), Health(Clock()))
    assert [c.name for c in plan.candidates] == ["client"]


# -- synchronous answers ---------------------------------------------------------------------

def body(name):
    return (WIRE / "http" / name).read_bytes()


@pytest.mark.parametrize(
    "status,payload,verdict,reason",
    [
        (200, b"{}", "commit", "ok"),
        (503, body("503_server_is_overloaded_full.json"), "failover", "overloaded"),
        (503, body("503_server_is_overloaded_minimal.json"), "failover", "overloaded"),
        (503, b"not json", "failover", "upstream_5xx"),  # a gateway's page: the way failed, not the account
        (529, b"", "failover", "overloaded"),
        (429, json.dumps({"error": {"type": "usage_limit_reached", "resets_in_seconds": 30}}).encode(), "failover", "usage_limit"),
        (429, b"{}", "failover", "rate_limited"),
        (500, body("500_generic.json"), "failover", "upstream_5xx"),
        (502, b"", "failover", "upstream_5xx"),
        (401, b"{}", "failover", "auth_rejected"),
        (403, b"{}", "failover", "auth_rejected"),
        (400, body("400_invalid_encrypted_content.json"), "deliver", "client_error"),
        (400, body("400_cyber_policy.json"), "deliver", "client_error"),
        (404, b"", "deliver", "client_error"),
    ],
)
def test_classify_response(rules, status, payload, verdict, reason):
    out = classify_response(status, payload, rules)
    assert (out.verdict, out.reason) == (verdict, reason)


@pytest.mark.parametrize(
    "reason,error,retry_after,expected",
    [
        ("overloaded", {}, None, 60),
        ("overloaded", {}, "7", 7),
        ("overloaded", {}, "Wed, 15 Jan 2027 08:00:10 GMT", None),
        ("usage_limit", {"resets_in_seconds": 120}, None, 120),
        ("usage_limit", {"resets_at": 1_800_000_300}, None, 300),
        ("usage_limit", {"resets_at": 1_800_000_300_000}, None, 300),  # milliseconds
        ("usage_limit", {"resets_in_seconds": 10**12}, None, 7 * 24 * 3600),  # absurd: capped
        ("rate_limited", {"message": "Please try again in 11.054s."}, None, 11.054),
        ("rate_limited", {"message": "Please try again in 500ms."}, None, 1.0),  # floor 1 s
        ("closed_before_output", {}, None, 0),
        ("upstream_5xx", {}, "30", 0),
        ("auth_rejected", {}, None, 0),
    ],
)
def test_cooldowns(reason, error, retry_after, expected):
    now = 1_800_000_000.0
    got = cooldown_seconds(reason, error, retry_after, now, Policy())
    if expected is None:
        expected = retry_after_seconds(retry_after, now)
    assert got == pytest.approx(min(max(expected, 1), 7 * 24 * 3600) if expected else 0)


def test_exhausted_status():
    assert exhausted_status("overloaded") == 503
    assert exhausted_status("usage_limit") == 429
    assert exhausted_status("capacity") == 429
    assert exhausted_status("server_error_retryable") == 503


@pytest.mark.parametrize(
    "message,started,expected",
    [
        ("[Errno 111] Connect call failed ('127.0.0.1', 1)", False, PRE_DISPATCH),
        ("[Errno -2] Name or service not known", False, HOST_NETWORK),
        ("[Errno 101] Network is unreachable", False, HOST_NETWORK),
        ("Certificate verify failed: self-signed certificate", False, TLS_FAILED),
        ("peer closed connection without sending complete message body", False, AMBIGUOUS),
        ("[Errno 111] Connect call failed", True, AMBIGUOUS),
    ],
)
def test_connection_errors(message, started, expected):
    assert classify_connection_error(message, started) == expected


# -- endpoints and moving a request ---------------------------------------------------------

def test_endpoint_matcher():
    m = EndpointMatcher(["http://127.0.0.1:9000/v1", "https://proxy.example/openai/"])
    assert m.matches("api.openai.com", 443, "/v1/responses")
    assert m.matches("chatgpt.com", 443, "/backend-api/codex/responses?x=1")
    assert m.matches("127.0.0.1", 9000, "/v1/responses")
    assert m.matches("proxy.example", 443, "/openai/responses")
    assert m.matches("api.openai.com", 443, "/v1/responses/compact")  # held too: it may fail over
    assert m.matches("127.0.0.1", 9000, "/v1/responses/compact")
    assert not m.matches("api.openai.com", 443, "/v1/responses/compacted")
    assert not m.matches("api.openai.com", 443, "/v1/models")
    assert not m.matches("evil.example", 443, "/v1/responses")
    assert not m.matches("127.0.0.1", 9001, "/v1/responses")


def test_asks_to_stream():
    assert asks_to_stream(parse_body(b'{"stream": true, "input": []}'))
    assert not asks_to_stream(parse_body(b'{"stream": false}'))
    assert not asks_to_stream(parse_body(b""))
    assert not asks_to_stream(parse_body(b"[1]"))
    assert parse_body(b"{bad json") is None


def test_swap_credential_replaces_identity_and_drops_turn_state_when_moved():
    headers = {"authorization": "Bearer old", "chatgpt-account-id": "old", "x-codex-turn-state": "t", "session-id": "s"}
    swap_credential(headers, AuthMaterial(CHATGPT, "new", account_id="acct2"), moved=True)
    assert headers == {"session-id": "s", "Authorization": "Bearer new", "ChatGPT-Account-ID": "acct2"}
    headers = {"authorization": "Bearer old", "x-codex-turn-state": "t"}
    swap_credential(headers, AuthMaterial(APIKEY, "k"), moved=False)
    assert headers["x-codex-turn-state"] == "t"
