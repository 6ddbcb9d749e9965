"""The WebSocket gate's pure core: turns, the hold window, order, and which turns may move."""

import json

import pytest
from conftest import LIVE, WIRE, Clock
from hypothesis import given, settings, strategies as st

from codex_failover.core.vocabulary import Verdict
from codex_failover.core.ws_turns import Step, TurnGate, parse_create


def msg(obj) -> tuple[bytes, bool]:
    return (obj if isinstance(obj, bytes) else json.dumps(obj).encode()), True


def fixture(name) -> dict:
    return json.loads((WIRE / "ws" / name).read_text())


CREATED = {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
IN_PROGRESS = {"type": "response.in_progress", "response": {"id": "resp_1"}}
RATE = fixture("server_codex_rate_limits.json")
DELTA = {"type": "response.output_text.delta", "delta": "Hi"}
COMPLETED = {"type": "response.completed", "response": {"id": "resp_1", "output": []}}
CREATE = {"type": "response.create", "model": "m", "input": [{"type": "message", "role": "user", "content": []}]}


def gate(rules, **kw) -> TurnGate:
    g = TurnGate(rules, **kw)
    g.client_message(*msg(CREATE), {})
    return g


@pytest.mark.parametrize("name, tail, verdict, reason", [
    ("wrapped 503 overload", [fixture("server_error_server_is_overloaded_503.json")], Verdict.FAILOVER, "overloaded"),
    ("wrapped 429 usage limit", [fixture("server_error_usage_limit_reached_429.json")], Verdict.FAILOVER, "usage_limit"),
    ("overload without status: classified by its body", [fixture("server_error_server_is_overloaded_no_status.json")],
     Verdict.FAILOVER, "overloaded"),
    ("response.failed overload", [fixture("server_response_failed_server_is_overloaded.json")], Verdict.FAILOVER, "overloaded"),
    ("response.failed other: delivered", [fixture("server_response_failed_invalid_prompt.json")], Verdict.DELIVER, "terminal_error"),
    ("wrapped 400: delivered", [fixture("server_error_invalid_request_400.json")], Verdict.DELIVER, "terminal_error"),
    ("delta then a terminal error: committed at the delta", [DELTA, fixture("server_error_invalid_request_400.json")],
     Verdict.COMMIT, "output"),
    ("rate limits and empty messages are held", [RATE, b"", DELTA], Verdict.COMMIT, "output"),
])
def test_turn_decisions(rules, name, tail, verdict, reason):
    g = gate(rules)
    steps = [g.server_message(*msg(m)) for m in [CREATED, IN_PROGRESS, *tail]]
    decided = [s for s in steps if s.decision is not None]
    assert len(decided) == 1, name
    assert (decided[0].decision.verdict, decided[0].decision.reason) == (verdict, reason)
    released = [m for s in steps for m in s.release]
    if verdict is Verdict.FAILOVER:
        assert released == []
        assert list(decided[0].held) == [msg(m) for m in [CREATED, IN_PROGRESS, *tail]]
    else:  # everything, in order, exactly once; the deciding step releases all held so far
        assert released == [msg(m) for m in [CREATED, IN_PROGRESS, *tail]]
        assert len(decided[0].release) == steps.index(decided[0]) + 1


def test_messages_outside_a_turn_pass_at_once(rules):
    g = TurnGate(rules)
    assert g.server_message(*msg(RATE)).release == (msg(RATE),)
    g = gate(rules)
    for m in [CREATED, DELTA]:
        g.server_message(*msg(m))
    assert not g.holding
    assert g.server_message(*msg(COMPLETED)).release == (msg(COMPLETED),)


def test_budget_counts_empty_messages(rules):
    g = gate(rules)
    steps = [g.server_message(b"", True) for _ in range(rules.max_frames + 1)]
    assert steps[-1].decision.reason == "frame_budget"
    assert len(steps[-1].release) == rules.max_frames + 1


def test_time_budget_commits_on_tick(rules):
    clock = Clock()
    g = gate(rules, timeout=5.0, clock=clock)
    g.server_message(*msg(CREATED))
    assert g.tick().decision is None
    clock.now += 5
    step = g.tick()
    assert step.decision.reason == "timeout"
    assert step.release == (msg(CREATED),)


def test_a_turn_held_past_the_budget_catches_a_late_overload(rules):
    """bootstrap_timeout 30 s, first_event_timeout 60 s, max_hold 300 s: an overload 40 s after
    response.created, only rate-limit messages before it, still moves (the socket needs no keepalive)."""
    clock = Clock()
    g = gate(rules, timeout=30.0, clock=clock, stall=60.0, max_hold=300.0)
    start = clock.now
    g.server_message(*msg(CREATED))
    clock.now += 30
    assert g.tick().decision is None and g.deadline == start + 60  # extended: silent since the start
    clock.now += 5
    assert g.server_message(*msg(RATE)).decision is None
    assert g.deadline == start + 95
    clock.now += 5
    step = g.server_message(*msg(fixture("server_error_server_is_overloaded_503.json")))
    assert (step.decision.verdict, step.decision.reason) == (Verdict.FAILOVER, "overloaded")


def test_a_turn_silent_past_first_event_timeout_moves_and_keepalives_end_at_max_hold(rules):
    clock = Clock()
    g = gate(rules, timeout=30.0, clock=clock, stall=60.0, max_hold=300.0)
    g.server_message(*msg(CREATED))
    clock.now += 59.9
    assert g.tick().decision is None
    clock.now += 0.1
    step = g.tick()
    assert (step.decision.verdict, step.decision.reason) == (Verdict.FAILOVER, "stalled_before_output")
    busy = gate(rules, timeout=30.0, clock=clock, stall=60.0, max_hold=300.0)
    for _ in range(30):
        clock.now += 10
        step = busy.server_message(*msg(RATE))
    assert (step.decision.verdict, step.decision.reason) == (Verdict.COMMIT, "timeout")


OVERLOAD_503 = fixture("server_error_server_is_overloaded_503.json")
MESSAGE_DONE = {"type": "response.output_item.done", "item": {"type": "message", "content": []}}
CALL_DONE = {"type": "response.output_item.done", "item": {"type": "function_call", "name": "shell", "arguments": "{}"}}
REASONING_DONE = {"type": "response.output_item.done", "item": {"type": "reasoning", "summary": []}}


@pytest.mark.parametrize("name, after, late", [
    ("an overload after a few deltas: a close Codex retries", [DELTA, DELTA], True),
    ("after a whole message item: delivered (a re-send would repeat its text)", [DELTA, MESSAGE_DONE], False),
    ("after a tool call item: delivered (Codex may have run it)", [DELTA, CALL_DONE], False),
    ("after a reasoning item only: a close Codex retries", [DELTA, REASONING_DONE], True),
    ("after the response completed: not this turn's", [DELTA, COMPLETED], False),
])
def test_a_rejection_after_output(rules, name, after, late):
    g = gate(rules)
    g.server_message(*msg(CREATED))
    assert g.server_message(*msg(DELTA)).decision.verdict is Verdict.COMMIT
    for m in after:
        assert g.server_message(*msg(m)).release == (msg(m),)
    step = g.server_message(*msg(OVERLOAD_503))
    if late:
        assert step.after_output and step.release == () and step.held == (msg(OVERLOAD_503),)
        assert (step.decision.verdict, step.decision.reason) == (Verdict.FAILOVER, "overloaded")
    else:
        assert step.decision is None and step.release == (msg(OVERLOAD_503),)


def test_a_terminal_error_after_output_that_is_no_rejection_is_delivered(rules):
    g = gate(rules)
    g.server_message(*msg(DELTA))
    invalid = fixture("server_error_invalid_request_400.json")
    assert g.server_message(*msg(invalid)) == Step(release=(msg(invalid),))


def test_upstream_closing_inside_the_window_is_a_rejection(rules):
    g = gate(rules)
    g.server_message(*msg(CREATED))
    step = g.upstream_closed()
    assert step.decision.verdict is Verdict.FAILOVER
    assert step.decision.reason == "closed_before_output"
    assert gate(rules).upstream_closed().decision.verdict is Verdict.FAILOVER
    assert TurnGate(rules).upstream_closed().decision is None


def test_only_self_contained_turns_move(rules):
    g = TurnGate(rules)
    first = g.client_message(*msg(CREATE), {})
    g.server_message(*msg(COMPLETED))
    later = g.client_message(*msg({**CREATE, "previous_response_id": "resp_x"}), {})
    assert first.movable
    assert first.n == 1
    assert not later.movable
    assert "previous_response_id" in later.why_pinned
    pinned = TurnGate(rules).client_message(*msg(CREATE), {"x-codex-failover-pin": "true"})
    assert not pinned.movable


def test_a_turn_after_a_warmup_moves_without_the_warmup_id(rules):
    frames = [json.loads(line) for line in (LIVE / "apikey_ws_client_frames.jsonl").read_text().splitlines()]
    g = TurnGate(rules)
    warm = g.client_message(*msg(frames[0]), {})
    assert warm.movable
    assert warm.warmup
    for m in [{**CREATED, "response": {"id": frames[1]["previous_response_id"]}}, COMPLETED]:
        g.server_message(*msg(m))
    first = g.client_message(*msg(frames[1]), {})
    assert first.movable
    assert first.message_for(new_socket=False, foreign=True) == msg(frames[1])  # its warm-up is on this socket
    body, is_text = first.message_for(new_socket=True, foreign=False)
    moved = json.loads(body)
    assert is_text
    assert "previous_response_id" not in moved
    assert moved["input"] == frames[1]["input"]
    follow = g.client_message(*msg(frames[2]), {})
    assert not follow.movable


def test_warmup_shortcut_needs_the_turn_to_repeat_the_warmups_fields(rules):
    g = TurnGate(rules)
    g.client_message(*msg({**CREATE, "input": [], "generate": False, "instructions": "x"}), {})
    g.server_message(*msg(CREATED))
    turn = g.client_message(*msg({**CREATE, "previous_response_id": "resp_1"}), {})
    assert not turn.movable


def test_another_accounts_copy_strips_encrypted_reasoning(rules):
    body = {**CREATE, "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}
    turn = TurnGate(rules).client_message(*msg(body), {})
    for new_socket in (True, False):
        moved = json.loads(turn.message_for(new_socket=new_socket, foreign=True)[0])
        assert turn.movable
        assert "encrypted_content" not in moved["input"][0]
    assert turn.message_for(new_socket=True, foreign=False) == msg(body)  # the client's own account reads it
    plain = TurnGate(rules).client_message(*msg(CREATE), {})
    assert plain.message_for(new_socket=True, foreign=True) == msg(CREATE)  # unchanged bytes when nothing changes


def test_a_self_contained_turn_with_a_compaction_item_stays_home(rules):
    body = {**CREATE, "input": [{"type": "compaction", "encrypted_content": "x"}]}
    turn = TurnGate(rules).client_message(*msg(body), {})
    assert not turn.movable
    assert turn.stays_home
    g = TurnGate(rules)
    g.client_message(*msg(CREATE), {})
    g.server_message(*msg(COMPLETED))
    later = g.client_message(*msg({**body, "previous_response_id": "resp_1"}), {})
    assert not later.stays_home  # it continues this socket's response: it belongs here


def test_a_warmup_that_continues_a_response_is_not_a_warmup(rules):
    g = TurnGate(rules)
    g.client_message(*msg(CREATE), {})
    g.server_message(*msg(COMPLETED))
    chained = g.client_message(*msg({**CREATE, "input": [], "generate": False, "previous_response_id": "resp_1"}), {})
    assert not chained.warmup
    g.server_message(*msg({**CREATED, "response": {"id": "resp_2"}}))
    g.server_message(*msg(COMPLETED))
    follow = g.client_message(*msg({**CREATE, "previous_response_id": "resp_2"}), {})
    assert not follow.movable


def test_a_create_while_a_turn_is_held_keeps_the_window_and_drops_nothing(rules):
    g = gate(rules)
    g.server_message(*msg(CREATED))
    second = g.client_message(*msg(CREATE), {})
    assert not second.movable
    assert g.holding
    step = g.server_message(*msg(DELTA))
    assert step.release == (msg(CREATED), msg(DELTA))


def test_parse_create_ignores_other_messages():
    assert parse_create(b'{"type":"response.cancel"}') is None
    assert parse_create(b'not json "response.create"') is None
    assert parse_create(json.dumps(CREATE)) == CREATE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["created", "rate", "empty", "delta", "reject"]), min_size=1, max_size=60))
def test_every_message_is_released_once_in_order_or_swallowed(rules, kinds):
    table = {"created": CREATED, "rate": RATE, "empty": b"", "delta": DELTA,
             "reject": fixture("server_error_server_is_overloaded_503.json")}
    g = gate(rules)
    sent = [msg(table[k]) for k in kinds]
    out, swallowed, seen = [], [], []  # seen: each message where it left the gate, released or swallowed
    for m in sent:
        step = g.server_message(*m)
        out += step.release
        swallowed += step.held
        seen += [*step.release, *step.held]
    end = g.upstream_closed()
    out += end.release
    swallowed += end.held
    seen += [*end.release, *end.held]
    assert seen == sent  # (a rejection after output is swallowed where it came; the rest goes on)
    if not swallowed:
        assert out == sent
