"""May a request move? Pure policy, on real-shaped bodies."""

import json

import pytest
from conftest import LIVE, WIRE

from codex_failover.core.replay_safety import PIN_HEADER, assess, strip_encrypted_reasoning

BODY = json.loads((WIRE / "http" / "responses_request_body.json").read_text())  # has encrypted reasoning
LIVE_BODY = json.loads((LIVE / "chatgpt_http_post_responses_followup.body.json").read_text())


def test_live_codex_follow_up_moves_freely():
    move = assess(LIVE_BODY, {})
    assert move.movable
    assert not move.strip_reasoning


def test_encrypted_reasoning_is_stripped_by_default_and_nothing_else_changes():
    move = assess(BODY, {})
    assert move.movable
    assert move.strip_reasoning
    stripped = strip_encrypted_reasoning(BODY)
    reasoning = [i for i in stripped["input"] if i.get("type") == "reasoning"]
    assert reasoning
    assert all("encrypted_content" not in i for i in reasoning)
    assert all(i.get("summary") == o.get("summary") for i, o in zip(reasoning, [i for i in BODY["input"] if i.get("type") == "reasoning"], strict=False))
    # Everything but that one field is identical.
    restored = [dict(i, encrypted_content=o["encrypted_content"]) if "encrypted_content" in o else i
                for i, o in zip(stripped["input"], BODY["input"], strict=False)]
    assert {**stripped, "input": restored} == BODY
    assert "encrypted_content" in json.dumps(BODY)  # the original is untouched


def test_pin_policy_keeps_encrypted_reasoning_home():
    move = assess(BODY, {}, "pin")
    assert not move.movable
    assert "encrypted reasoning" in move.why_pinned


@pytest.mark.parametrize(
    "body,why",
    [
        ({"previous_response_id": "resp_1", "input": []}, "previous_response_id"),
        ({"input": [{"type": "compaction", "encrypted_content": "x"}]}, "compaction"),
    ],
)
def test_state_bound_requests_stay(body, why):
    move = assess(body, {})
    assert not move.movable
    assert why in move.why_pinned


def test_user_pin_header():
    assert not assess(LIVE_BODY, {PIN_HEADER: "true"}).movable
    assert assess(LIVE_BODY, {PIN_HEADER: "no"}).movable


def test_odd_bodies_do_not_crash():
    assert assess(None, {}).movable
    assert assess({"input": "text"}, {}).movable
    assert strip_encrypted_reasoning({"input": "text"}) == {"input": "text"}
