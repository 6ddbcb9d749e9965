"""What a rejection says about the account, the route or the model, on a clock: the rules' new fields,
the model book and the plan that skips a credential for one model only, the edge's refusals against
the route, a WebSocket turn whose socket lost its state, the attestation header, and the usage view
of a Business account (`rate_limit: null`, `spend_control`)."""

from __future__ import annotations

import json

import pytest
from conftest import WIRE, Clock
from test_failover_loop import ROUTED, World, drive, rej

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.auth import APIKEY, AuthMaterial
from codex_failover.core.classifier import stream_error
from codex_failover.core.codex_request import model_of, swap_credential
from codex_failover.core.cooldown_end import usage_has_headroom, usage_windows
from codex_failover.core.entitlement import ModelBook
from codex_failover.core.failover_loop import FailoverLoop
from codex_failover.core.health import Health
from codex_failover.core.outcomes import SERVED
from codex_failover.core.planner import NOT_ENTITLED, make_plan
from codex_failover.core.replay_safety import ATTESTATION, assess
from codex_failover.core.taxonomy import classify_response, cooldown_seconds, exhausted_status
from codex_failover.core.usage_view import own_can_send, pooled_view
from codex_failover.core.vocabulary import EDGE_BLOCKED, MODEL_NOT_ENTITLED, WORKSPACE_LIMIT
from codex_failover.core.ws_turns import TurnGate

NOW = 1_800_000_000.0


# -- synchronous answers: headers, params, statuses -------------------------------------------------

@pytest.mark.parametrize("status,body,headers,want", [
    # a challenge is known by its header, whatever its body
    (403, b'{"error": {"message": "blocked"}}', {"cf-mitigated": "challenge"}, ("failover", EDGE_BLOCKED)),
    (403, b"", {}, ("failover", EDGE_BLOCKED)),  # no JSON error at all: the edge's
    (403, b"{}", {}, ("failover", "auth_rejected")),  # a JSON 403 naming nothing: still the credential's
    (401, b"", {}, ("failover", "auth_rejected")),  # a 401 is the credential's whatever its body
    (401, b'{"error": {"code": "token_expired"}}', {}, ("failover", "auth_rejected")),
    # the workspace cap is the header's word; without it, the same body is the account's usage limit
    (429, b'{"error": {"type": "usage_limit_reached"}}', {"x-codex-rate-limit-reached-type":
                                                         "workspace_member_usage_limit_reached"}, ("failover", WORKSPACE_LIMIT)),
    (429, b'{"error": {"type": "usage_limit_reached"}}', {}, ("failover", "usage_limit")),
    # a param naming the model decides only on a 404: a 400 invalid_value about the model is the client's
    (400, b'{"error": {"code": "invalid_value", "param": "model", "message": "Invalid model."}}', {},
     ("deliver", "client_error")),
    (404, b'{"error": {"code": null, "param": "model", "message": "Not here."}}', {}, ("failover", MODEL_NOT_ENTITLED)),
    (400, b'{"detail": "The \'gpt-x\' model is not supported when using Codex with a ChatGPT account."}', {},
     ("failover", MODEL_NOT_ENTITLED)),
])
def test_a_synchronous_answer_by_body_headers_and_status(rules, status, body, headers, want):
    v = classify_response(status, body, rules, headers)
    assert (v.verdict, v.reason) == want


def test_a_page_is_matched_far_enough_and_never_kept(rules):
    page = (WIRE / "shapes" / "403_cloudflare_blocked.html").read_bytes()
    v = classify_response(403, b" " * 4000 + page, rules)
    assert v.reason == EDGE_BLOCKED and "message" not in v.error


@pytest.mark.parametrize("reason,seconds", [(EDGE_BLOCKED, 0.0), (MODEL_NOT_ENTITLED, 0.0), (WORKSPACE_LIMIT, 6 * 3600.0)])
def test_how_long_each_new_class_rests_its_credential(reason, seconds):
    assert cooldown_seconds(reason, {}, None, NOW, Policy()) == seconds


def test_a_workspace_cap_that_names_its_reset_rests_until_then():
    assert cooldown_seconds(WORKSPACE_LIMIT, {"resets_at": NOW + 120}, None, NOW, Policy()) == 120


def test_what_an_exhausted_request_is_answered_with():
    assert exhausted_status(WORKSPACE_LIMIT) == 429  # final for Codex, as a usage limit
    assert exhausted_status(MODEL_NOT_ENTITLED) == 400  # Codex does not re-send a model nobody has
    assert exhausted_status(EDGE_BLOCKED) == 502


# -- in-stream errors: where Codex reads them ----------------------------------------------------

@pytest.mark.parametrize("payload,want", [
    ({"type": "error", "status_code": 503, "error": {"code": "x"}}, {"code": "x", "status": 503}),
    ({"type": "error", "status": 429, "status_code": 503, "error": {}}, {"status": 429}),
    ({"type": "response.failed", "error": {"message": "m"}, "response": {"error": None}}, {"message": "m"}),
    ({"type": "response.failed", "error": {"message": "top"}, "response": {"error": {"message": "inner"}}},
     {"message": "inner"}),
    ({"type": "error", "response": {"error": {"code": "c"}}}, {"code": "c"}),
    ({"type": "response.failed", "response": {"status": "failed"}}, {}),
    ({"type": "error", "code": "server_is_overloaded", "status_code": 503}, {"code": "server_is_overloaded", "status": 503}),
])
def test_stream_error_reads_both_places_and_both_status_names(payload, want):
    assert stream_error(payload) == want


# -- the model book and the plan ---------------------------------------------------------------------

def cred(name: str) -> Credential:
    return Credential(name, AuthMaterial(APIKEY, f"tok-{name}"), "https://api.example/v1", "$X")


CLIENT_AUTH = AuthMaterial(APIKEY, "tok-client")


def test_the_model_book_forgets_after_a_while_and_stays_bounded():
    clock = Clock()
    book = ModelBook(keep=60, max_entries=2, clock=clock)
    assert book.not_entitled("a", "pro")
    assert book.lacks("a", "pro") and not book.lacks("a", "mini") and not book.lacks("b", "pro")
    clock.now += 60
    assert not book.lacks("a", "pro"), "forgotten after `keep`"
    book.not_entitled("a", "x")
    book.not_entitled("b", "y")
    book.not_entitled("c", "z")
    assert [(k, m) for k, m, _ in book.entries()] == [("b", "y"), ("c", "z")], "the oldest goes first"
    assert not book.not_entitled("a", None) and not book.not_entitled("a", "m" * 500)
    book.forget("b")
    assert not book.lacks("b", "y")


def test_the_plan_skips_a_credential_for_the_model_it_lacks_only():
    clock = Clock()
    health = Health(clock)
    pool = PoolConfig((cred("free"), cred("plus")), Policy(use_client_credential=False))
    health.models.not_entitled("free", "gpt-pro")
    pro = make_plan(CLIENT_AUTH, pool, health, True, model="gpt-pro")
    assert [c.name for c in pro.candidates] == ["plus"] and [c.name for c in pro.lacking] == ["free"]
    assert "free" not in pro.all_keys, "never waited for, never dialled"
    other = make_plan(CLIENT_AUTH, pool, health, True, model="gpt-mini")
    assert [c.name for c in other.candidates] == ["free", "plus"] and not other.lacking
    clock.now += 3600
    assert [c.name for c in make_plan(CLIENT_AUTH, pool, health, True, model="gpt-pro").candidates] == ["free", "plus"]


def test_a_model_every_credential_lacks_is_answered_without_dialling():
    world = World(creds=(cred("free"), cred("plus")))
    for name in ("free", "plus"):
        world.health.models.not_entitled(world.key(name), "gpt-pro")
    loop = FailoverLoop(lambda: make_plan(CLIENT_AUTH, world.pool, world.health, True, model="gpt-pro"), world.health,
                      world.route_health, world.pool, clock=world.clock)
    steps, last = drive(world, loop, {})
    assert steps == [f"all cooling (free {NOT_ENTITLED} None; plus {NOT_ENTITLED} None), retry-after None"]


# -- the route -----------------------------------------------------------------------------------------

def test_an_edge_refusal_backs_its_endpoint_off_and_keeps_the_credential():
    world = World(**ROUTED)
    loop = world.loop()
    step = loop.next()
    assert step.endpoint == world.endpoint(0)
    assert loop.report(rej(EDGE_BLOCKED, 403)) is True
    assert world.route_health.describe(world.endpoint(0)).startswith("backing off 30s")
    assert world.health.ready(world.key("a"))
    assert any("the edge refused" in line for line in world.told)


def test_the_only_credential_is_retried_after_an_edge_refusal():
    world = World(creds=(cred("a"),), cooldown_wait=2.0)
    steps, last = drive(world, world.loop(), {"a": [rej(EDGE_BLOCKED, 403), rej(EDGE_BLOCKED, 403), SERVED]})
    assert steps == ["try a #1", "wait 0.5s (backoff)", "try a #2", "wait 1s (backoff)", "try a #3"] and last is SERVED
    assert world.states() == {"a": "ready"}


# -- a WebSocket turn whose socket lost its state ---------------------------------------------------------

def turn_gate(rules, previous: str | None):
    gate = TurnGate(rules)
    create = {"type": "response.create", "model": "m", "input": []}
    if previous:
        create["previous_response_id"] = previous
    gate.client_message(json.dumps(create).encode(), True, {})
    return gate


def test_previous_response_not_found_on_a_continued_turn_is_lost_state_not_an_answer(rules):
    frame = (WIRE / "shapes" / "ws_error_previous_response_not_found.json").read_bytes()
    step = turn_gate(rules, "resp_abc123").server_message(frame, True)
    assert step.decision.reason == "state_lost" and not step.release and step.held
    # A turn that named no response gets the same error as the client's own answer.
    step = turn_gate(rules, None).server_message(frame, True)
    assert step.decision.reason == "terminal_error" and step.release


# -- x-oai-attestation -------------------------------------------------------------------------------------

def test_the_attestation_stays_on_its_own_account_and_never_pins_the_request():
    sent = {"authorization": "Bearer tok-client", ATTESTATION: '{"v":1,"s":0,"t":"v1.opaque"}', "session-id": "s"}
    assert assess({"model": "m", "input": []}, sent).movable, "a request carrying it may move"
    moved = dict(sent)
    swap_credential(moved, AuthMaterial(APIKEY, "tok-pool"), moved=True)
    assert ATTESTATION not in moved and moved["session-id"] == "s"
    own = dict(sent)
    swap_credential(own, AuthMaterial(APIKEY, "tok-client"), moved=False)
    assert own[ATTESTATION] == sent[ATTESTATION]


def test_model_of():
    assert model_of({"model": "gpt-pro"}) == "gpt-pro"
    assert model_of({"model": 3}) is None and model_of(None) is None and model_of({"model": ""}) is None


# -- the usage view of a Business account -----------------------------------------------------------------

def business(reached=False, used=96):
    doc = json.loads((WIRE / "http" / "wham_usage_rate_limit_null_spend_control.json").read_text())
    doc["spend_control"]["reached"] = reached
    doc["spend_control"]["individual_limit"]["used_percent"] = used
    return doc


def test_a_spend_controlled_account_reads_as_one_window():
    doc = business()
    assert [(w.name, w.used_percent, w.resets_at) for w in usage_windows(doc)] == [("spend_control", 96.0, 1798761600.0)]
    assert usage_has_headroom(doc) is True
    assert usage_has_headroom(doc, 90.0) is False, "the credential's own max_usage_percent"
    assert usage_has_headroom(business(reached=True, used=10)) is False
    assert usage_has_headroom(business(used=100)) is False
    assert usage_has_headroom({"rate_limit": None}) is None
    assert usage_has_headroom({"rate_limit": None, "spend_control": "garbage"}) is None
    assert usage_windows({"rate_limit": None, "spend_control": {"individual_limit": {"used_percent": "x"}}}) == []


def test_the_pooled_view_of_a_spend_controlled_account_is_whole():
    doc = business()
    assert own_can_send(200, doc, True)
    assert not own_can_send(200, business(reached=True), True)
    view = pooled_view(doc, "work-b", 200)
    assert view["rate_limit"] is None and view["spend_control"] == doc["spend_control"]
    assert view["codex_failover"]["served_by"] == "work-b"
    assert "additional_rate_limits" not in view or view["additional_rate_limits"] is None
