"""What a rejection says about the account, the route or the model, on a clock: the rules' new fields,
the model book and the plan that skips a credential for one model only, the edge's refusals against
the route, a WebSocket turn whose socket lost its state, the attestation header, and the usage view
of a Business account (`rate_limit: null`, `spend_control`)."""

from __future__ import annotations

import json

import pytest
from conftest import WIRE, Clock
from test_failover_loop import World, cred as routed, drive, rej

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
from codex_failover.core.vocabulary import EDGE_BLOCKED, FORBIDDEN_PAGE, MODEL_NOT_ENTITLED, WORKSPACE_LIMIT
from codex_failover.core.ws_turns import TurnGate

NOW = 1_800_000_000.0


# -- synchronous answers: headers, params, statuses -------------------------------------------------

@pytest.mark.parametrize("status,body,headers,want", [
    # a challenge is known by its header, whatever its body
    (403, b'{"error": {"message": "blocked"}}', {"cf-mitigated": "challenge"}, ("failover", EDGE_BLOCKED)),
    (403, b"", {}, ("failover", FORBIDDEN_PAGE)),  # no JSON error, no sign of the edge: nothing's
    (403, b"Forbidden", {}, ("failover", FORBIDDEN_PAGE)),
    # the edge's evidence counts on a 403 only: a 400/401 quoting it is not the edge's answer
    (400, b'{"error": {"code": "invalid_value", "param": "input", "message": "Invalid value: \'Sorry, you have been '
          b'blocked\'."}}', {}, ("deliver", "client_error")),
    (400, b'{"error": {"code": "invalid_value", "message": "bad"}}', {"cf-mitigated": "challenge"},
     ("deliver", "client_error")),
    (401, b'{"error": {"code": "token_expired", "message": "Country, region, or territory not supported"}}', {},
     ("failover", "auth_rejected")),
    (403, b'{"error": {"code": "unsupported_country_region_territory"}}', {}, ("failover", EDGE_BLOCKED)),
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
    # only what the service says about the model: its status, and the param when the error names one
    (400, b'{"error": {"code": "invalid_value", "param": "reasoning.effort", "message": "Invalid value: \'x model is '
          b'not supported when using Codex with a ChatGPT account\'."}}', {}, ("deliver", "client_error")),
    (400, b'{"error": {"param": "model", "message": "The \'gpt-x\' model is not supported when using Codex with a '
          b'ChatGPT account."}}', {}, ("failover", MODEL_NOT_ENTITLED)),
    (404, b'{"detail": "The \'gpt-x\' model is not supported when using Codex with a ChatGPT account."}', {},
     ("deliver", "client_error")),
    (404, b'{"error": {"code": "model_not_found", "message": "No such model."}}', {}, ("failover", MODEL_NOT_ENTITLED)),
    (400, b'{"error": {"code": "model_not_found", "param": "input", "message": "x"}}', {}, ("deliver", "client_error")),
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

SHARED = {"creds": [routed("a", "corp"), routed("b", "corp")],  # two accounts on one endpoint
          "routes": {"corp": ["http://p0:3128"]}}


def test_one_credentials_edge_refusal_backs_off_only_that_pair():
    """The edge's 403 to one account says nothing yet about the route: only that credential skips the
    endpoint for a while (it stays in rotation); the other account on the same endpoint is dialled."""
    world = World(**SHARED)
    steps, last = drive(world, world.loop(), {"a@corp[0]": [rej(EDGE_BLOCKED, 403)], "b@corp[0]": [SERVED]})
    assert steps == ["try a@corp[0] #1", "try b@corp[0] #2"] and last is SERVED
    assert world.route_health.healthy(world.endpoint(0)), "the endpoint does not back off for everyone"
    assert world.states() == {"a": "ready", "b": "ready"}
    assert any("the edge refused credential a" in line for line in world.told)
    # The next request: a is not sent through the endpoint during its episode (not penalised), b serves.
    steps, last = drive(world, world.loop(), {"b@corp[0]": [SERVED]})
    assert steps == ["route down a", "try b@corp[0] #2"] and last is SERVED
    world.clock.now += 30
    steps, last = drive(world, world.loop(), {"a@corp[0]": [SERVED]})
    assert steps == ["try a@corp[0] #1"], "after the episode a goes through it again"


def test_a_second_credentials_edge_refusal_backs_the_endpoint_off_for_all():
    world = World(**SHARED)
    loop = world.loop()
    assert loop.next().endpoint == world.endpoint(0)
    assert loop.report(rej(EDGE_BLOCKED, 403)) is True
    assert world.route_health.healthy(world.endpoint(0))
    assert loop.next().candidate.name == "b"
    assert loop.report(rej(EDGE_BLOCKED, 403)) is True  # two accounts, one answer: the route's
    assert world.route_health.describe(world.endpoint(0)).startswith("backing off 30s")
    assert world.states() == {"a": "ready", "b": "ready"}
    assert any("to a second credential; not dialled again for 30s" in line for line in world.told)


def test_one_credentials_refusals_count_once_per_episode():
    world = World(**SHARED)
    ep = world.endpoint(0)
    for left in (30.0, 29.0, 28.0):  # a refusal during the episode neither extends nor escalates it
        assert world.route_health.edge_refused(ep, "a", "the edge refused it") == (False, left)
        world.clock.now += 1
    assert world.route_health.healthy(ep) and not world.route_health.claim(ep, "a") and world.route_health.claim(ep, "b")
    world.clock.now += 28
    assert world.route_health.claim(ep, "a"), "the episode is over"


def test_a_403_page_with_no_sign_of_the_edge_moves_and_backs_nothing_off():
    world = World(**SHARED)
    steps, last = drive(world, world.loop(), {"a@corp[0]": [rej(FORBIDDEN_PAGE, 403)], "b@corp[0]": [SERVED]})
    assert steps == ["try a@corp[0] #1", "try b@corp[0] #2"] and last is SERVED
    assert world.route_health.healthy(world.endpoint(0)) and world.route_health.claim(world.endpoint(0), "a")
    assert world.states() == {"a": "ready", "b": "ready"}
    steps, _ = drive(world, world.loop(), {"a@corp[0]": [SERVED]})
    assert steps == ["try a@corp[0] #1"], "the credential goes through its endpoint at once"


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


# -- the model nobody was seen serving, and the answer as it came -----------------------------------------

THREE = {"creds": [routed("a"), routed("b"), routed("c")]}


def model_loop(world: World, model: str) -> FailoverLoop:
    return FailoverLoop(lambda: make_plan(CLIENT_AUTH, world.pool, world.health, True, model=model), world.health,
                        world.route_health, world.pool, clock=world.clock, model=model)


def test_a_model_nobody_served_moves_once_at_most_and_the_service_answers():
    """A typo'd model: the first account says it lacks it, one more is asked, then the client gets the
    service's own answer; the prompt is not sent to every account of the pool."""
    world = World(**THREE)
    first = rej(MODEL_NOT_ENTITLED, 400)
    steps, last = drive(world, model_loop(world, "gpt-5-cdoex"), {"a": [first], "b": [rej(MODEL_NOT_ENTITLED, 400)]})
    assert steps[:2] == ["try a #1", "try b #2"] and steps[2].startswith("exhausted: model_not_entitled")
    assert last.as_it_came is first.rejection, "the first account's own answer, as it came"


def test_a_model_some_credential_served_moves_on_to_the_one_whose_plan_has_it():
    world = World(**THREE)
    world.health.models.served(world.key("c"), "gpt-pro")
    steps, last = drive(world, model_loop(world, "gpt-pro"),
                        {"a": [rej(MODEL_NOT_ENTITLED, 400)], "b": [rej(MODEL_NOT_ENTITLED, 400)], "c": [SERVED]})
    assert steps == ["try a #1", "try b #2", "try c #3"] and last is SERVED


def test_serving_a_model_makes_it_known_and_clears_the_credentials_pair():
    clock = Clock()
    book = ModelBook(clock=clock)
    book.not_entitled("a", "m")
    assert not book.known("m") and book.lacks("a", "m")
    book.served("a", "m")
    assert book.known("m") and not book.lacks("a", "m") and not book.known(None) and not book.known("other")


def test_the_clients_own_edge_403_with_no_pool_is_its_answer_as_it_came():
    world = World(creds=(), use_client=True, cooldown_wait=0.0)
    own = rej(EDGE_BLOCKED, 403, code="unsupported_country_region_territory")
    steps, last = drive(world, world.loop(), {"client": [own]})
    assert steps == ["try client #1", "exhausted: edge_blocked, retry-after None"]
    assert last.as_it_came is own.rejection


def test_the_clients_own_edge_403_is_the_answer_when_the_pool_could_not_serve_either():
    world = World(creds=(routed("b"),), use_client=True)
    own = rej(EDGE_BLOCKED, 403, code="unsupported_country_region_territory")
    steps, last = drive(world, world.loop(), {"client": [own], "b": [rej(FORBIDDEN_PAGE, 403)]})
    assert steps == ["try client #1", "try b #2", "exhausted: forbidden_page, retry-after None"]
    assert last.as_it_came is own.rejection, "the client's own answer speaks of its own setup"


def test_an_answer_of_ours_when_another_rejection_decided_or_a_credential_comes_back():
    world = World(creds=(routed("b"),), use_client=True)
    steps, last = drive(world, world.loop(), {"client": [rej(EDGE_BLOCKED, 403)], "b": [rej("overloaded", 503)]})
    assert last.last.reason == "overloaded" and last.as_it_came is None, "an overload: Codex re-sends ours"
    world = World(creds=(routed("b"), routed("c")), use_client=True)
    world.cool("c", 600, "usage_limit")
    steps, last = drive(world, world.loop(), {"client": [rej(EDGE_BLOCKED, 403)], "b": [rej(EDGE_BLOCKED, 403)]})
    assert last.soonest is not None and last.as_it_came is None, "ours tells when c is back"


def test_a_websocket_turn_for_a_model_nobody_served_stops_after_the_second_account():
    from test_request_machine import World as TurnWorld, ws_rejection

    from codex_failover.core.turn_machine import TurnMachine, TurnState

    def settle(cand, rejection) -> TurnState:  # each a turn's window closing (a fresh turn machine)
        return TurnMachine(world.pool.policy.cooldown_wait, world.health.now).settle(scope, cand, rejection, [], True,
                                                                                     lambda: True)

    world = TurnWorld(creds=("a", "b", "c"))
    scope = world.scope()
    scope.model = "gpt-5-cdoex"
    a, b = make_plan(CLIENT_AUTH, world.pool, world.health, True).candidates[:2]
    lacks = ws_rejection(MODEL_NOT_ENTITLED, 400)
    assert settle(a, lacks) is TurnState.MOVING
    assert settle(b, lacks) is TurnState.DELIVERED, "the service's answer, delivered"
    world.health.models.served("c", "gpt-pro")
    scope.model = "gpt-pro"
    assert settle(a, lacks) is TurnState.MOVING
    assert settle(b, lacks) is TurnState.MOVING, "a model known to exist moves on"
