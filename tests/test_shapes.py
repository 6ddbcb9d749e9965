"""Every rejection shape of the real service (tests/fixtures/wire/shapes/shapes.yaml), through the
synchronous-answer taxonomy, the bootstrap classifier (SSE) and the classifier on WebSocket messages."""

import json
from types import SimpleNamespace

import pytest
import yaml
from conftest import WIRE

from codex_failover.core.affinity import Affinity
from codex_failover.core.attempt_machine import learn
from codex_failover.core.classifier import BootstrapClassifier
from codex_failover.core.framer import Event, SSEFramer
from codex_failover.core.health import COOLING, OUT, READY, Health
from codex_failover.core.outcomes import Rejection
from codex_failover.core.planner import Candidate
from codex_failover.core.policy import PoolConfig
from codex_failover.core.pool_feedback import PoolFeedback
from codex_failover.core.taxonomy import classify_response
from codex_failover.core.usage import UsageBook
from codex_failover.core.ws_turns import TurnGate

SHAPES = WIRE / "shapes"
TABLE = yaml.safe_load((SHAPES / "shapes.yaml").read_text())


def _decide(rules, shape) -> tuple[str, str]:
    verdict, reason, _ = _decide_with_error(rules, shape)
    return verdict, reason


def _decide_with_error(rules, shape) -> tuple[str, str, dict]:
    data = (SHAPES / shape["file"]).read_bytes()
    if shape["as"] == "http":
        v = classify_response(shape["status"], data, rules, shape.get("headers"))
        return v.verdict, v.reason, dict(v.error or {})
    if shape["as"] == "ws_turn":  # a turn that continues a response, through the gate's turn machine
        gate = TurnGate(rules)
        create = {"type": "response.create", "model": "gpt-fake", "previous_response_id": "resp_abc123", "input": []}
        gate.client_message(json.dumps(create).encode(), True, {})
        step = gate.server_message(data, True)
        assert step.decision is not None and not step.release, "the error is held, never delivered"
        return step.decision.verdict.value, step.decision.reason, dict(step.decision.error or {})
    clf = BootstrapClassifier(rules)
    if shape["as"] == "sse":
        framer = SSEFramer()
        events = framer.feed(data) + framer.close()
    else:
        events = [Event.from_ws_message(json.dumps({"type": "response.created", "response": {}})),
                  Event.from_ws_message(data.decode())]
    for ev in events:
        d = clf.feed(ev)
        if d.final:
            return d.verdict.value, d.reason, dict(d.error or {})
    d = clf.end()
    return d.verdict.value, d.reason, dict(d.error or {})


@pytest.mark.parametrize("shape", TABLE, ids=[s["file"] for s in TABLE])
def test_shape(rules, shape):
    assert shape["source"]
    assert _decide(rules, shape) == tuple(shape["expect"])


POOLED = Candidate("first", "first", None, None, False)


@pytest.mark.parametrize("shape", [s for s in TABLE if "pool" in s], ids=[s["file"] for s in TABLE if "pool" in s])
def test_what_the_shape_does_to_the_pool(rules, shape):
    """The pool effect of each shape on the pooled credential that answered it: out of rotation, a
    rest, nothing (the route's), or the model skipped for that credential only."""
    now = [1_000_000.0]
    health = Health(clock=lambda: now[0])
    feedback = PoolFeedback(health, Affinity(), UsageBook(), pool_size=2)
    scope = SimpleNamespace(feedback=feedback, pool=PoolConfig(), model="gpt-5.5-pro", where="")
    verdict, reason, error = _decide_with_error(rules, shape)
    learn(scope, POOLED, Rejection(reason, error.get("status"), error))
    state = health.state("first")
    expected = shape["pool"]
    if expected == "out":
        assert state.status == OUT
    elif expected == "cooling":
        assert state.status == COOLING and state.until - now[0] >= shape["rest"], state
    else:
        assert state.status == READY, state
        assert health.models.lacks("first", "gpt-5.5-pro") is (expected == "lacks_model")
        assert not health.models.lacks("first", "gpt-fake"), "another model keeps the credential"


def test_every_fixture_is_in_the_table():
    listed = {s["file"] for s in TABLE}
    assert listed == {p.name for p in SHAPES.iterdir() if p.name != "shapes.yaml"}


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_json_5xx_is_not_a_gateway_page(rules, status):
    """A JSON error without a known code keeps its old class: 503 is the service's overload."""
    body = json.dumps({"error": {"type": "server_error", "code": "upstream_unavailable", "message": "Try again."}}).encode()
    assert classify_response(status, body, rules).reason == ("overloaded" if status == 503 else "upstream_5xx")


def test_a_plain_text_page_saying_overloaded_is_an_overload(rules):
    v = classify_response(503, b"Our servers are currently overloaded. Please try again later.", rules)
    assert (v.verdict, v.reason) == ("failover", "overloaded")
    assert "message" not in v.error  # a page's text is matched, never kept
