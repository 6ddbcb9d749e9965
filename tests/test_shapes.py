"""Every rejection shape of the real service (tests/fixtures/wire/shapes/shapes.yaml), through the
synchronous-answer taxonomy, the bootstrap classifier (SSE) and the classifier on WebSocket messages."""

import json

import pytest
import yaml
from conftest import WIRE

from codex_failover.core.classifier import BootstrapClassifier
from codex_failover.core.framer import Event, SSEFramer
from codex_failover.core.taxonomy import classify_response

SHAPES = WIRE / "shapes"
TABLE = yaml.safe_load((SHAPES / "shapes.yaml").read_text())


def _decide(rules, shape) -> tuple[str, str]:
    data = (SHAPES / shape["file"]).read_bytes()
    if shape["as"] == "http":
        v = classify_response(shape["status"], data, rules)
        return v.verdict, v.reason
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
            return d.verdict.value, d.reason
    d = clf.end()
    return d.verdict.value, d.reason


@pytest.mark.parametrize("shape", TABLE, ids=[s["file"] for s in TABLE])
def test_shape(rules, shape):
    assert shape["source"]
    assert _decide(rules, shape) == tuple(shape["expect"])


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
