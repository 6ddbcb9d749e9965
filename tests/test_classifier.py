"""The bootstrap classifier: allow-list, rejections, budgets, timeout, end of stream."""

import json

import pytest
from conftest import LIVE, WIRE, Clock
from hypothesis import given, settings, strategies as st

from codex_failover.core.classifier import BootstrapClassifier
from codex_failover.core.framer import Event, SSEFramer
from codex_failover.core.vocabulary import Verdict


def sse(obj, name=None) -> bytes:
    head = f"event: {name or obj.get('type', 'x')}\n".encode() if isinstance(obj, dict) else b""
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return head + b"data: " + payload.encode() + b"\n\n"


def events_of(data: bytes, chunk=None):
    framer = SSEFramer()
    step = chunk or max(len(data), 1)
    out = []
    for i in range(0, len(data), step):
        out += framer.feed(data[i : i + step])
    return out + framer.close()


def run(rules, data: bytes, eof=False, chunk=None, **kw):
    """Feed a stream; return the first final decision (or HOLD) and everything released."""
    clf = BootstrapClassifier(rules, **kw)
    decision, released = None, []
    for ev in events_of(data, chunk):
        d = clf.feed(ev)
        released += d.release
        if decision is None and d.final:
            decision = d
    if decision is None and eof:
        decision = clf.end()
    return decision or clf.tick(), released, clf


CREATED = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress"}}
IN_PROGRESS = {"type": "response.in_progress", "sequence_number": 1, "response": {"id": "resp_1"}}
HANDSHAKE = sse(CREATED) + sse(IN_PROGRESS)


def nested_error(code, etype="service_unavailable_error", message="Our servers are currently overloaded."):
    return {"type": "error", "error": {"type": etype, "code": code, "message": message, "param": None}, "sequence_number": 2}


def failed(code, message="x"):
    return {"type": "response.failed", "response": {"id": "resp_1", "status": "failed", "error": {"code": code, "message": message}}}


RETRY_MSG = "An error occurred while processing your request. You can retry your request, or contact us."

# (id, stream after the handshake, verdict, reason, trigger)
TABLE = [
    ("nested overload", sse(nested_error("server_is_overloaded")), "failover", "overloaded", "error"),
    ("flat overload", sse({"type": "error", "code": "server_is_overloaded", "message": "overloaded"}), "failover", "overloaded", "error"),
    ("service_unavailable type only", sse(nested_error(None)), "failover", "overloaded", "error"),
    ("response.failed only", sse(failed("server_is_overloaded")), "failover", "overloaded", "response.failed"),
    ("slow_down", sse(failed("slow_down")), "failover", "slow_down", "response.failed"),
    ("capacity text", sse(failed(None, "Selected model is at capacity. Please try a different model.")), "failover", "capacity", "response.failed"),
    ("capacity code", sse(nested_error("model_at_capacity", etype="x", message="m")), "failover", "capacity", "error"),
    ("capacity code variant", sse(failed("model_is_at_capacity")), "failover", "capacity", "response.failed"),
    ("server_error retryable", sse(nested_error("server_error", "server_error", RETRY_MSG)), "failover", "server_error_retryable", "error"),
    ("server_error not retryable", sse(nested_error("server_error", "server_error", "Something broke.")), "deliver", "terminal_error", "error"),
    ("rate limit", sse(failed("rate_limit_exceeded", "Please try again in 11.054s.")), "failover", "rate_limited", "response.failed"),
    ("rate limit type", sse(nested_error("x", "rate_limit_error", "slow")), "failover", "rate_limited", "error"),
    ("usage limit", sse(nested_error("usage_limit_reached", "usage_limit_reached", "limit")), "failover", "usage_limit", "error"),
    ("invalid request", sse(nested_error("invalid_value", "invalid_request_error", "bad")), "deliver", "terminal_error", "error"),
    ("context length", sse(failed("context_length_exceeded")), "deliver", "terminal_error", "response.failed"),
    ("empty incomplete", sse({"type": "response.incomplete", "response": {"incomplete_details": {"reason": "max_output_tokens"}}}), "deliver", "incomplete", "response.incomplete"),
    ("delta commits", sse({"type": "response.output_text.delta", "delta": "hi"}), "commit", "output", "response.output_text.delta"),
    ("unknown event commits", sse({"type": "response.brand_new"}), "commit", "output", "response.brand_new"),
    ("web_search_call commits", sse({"type": "response.output_item.added", "item": {"type": "web_search_call", "status": "in_progress"}}), "commit", "output", "response.output_item.added"),
    ("unknown item commits", sse({"type": "response.output_item.added", "item": {"type": "local_shell_call"}}), "commit", "output", "response.output_item.added"),
    ("message with text commits", sse({"type": "response.output_item.added", "item": {"type": "message", "content": [{"type": "output_text", "text": "hi"}]}}), "commit", "output", "response.output_item.added"),
    ("message with image commits", sse({"type": "response.output_item.added", "item": {"type": "message", "content": [{"type": "output_image"}]}}), "commit", "output", "response.output_item.added"),
    ("reasoning with encrypted commits", sse({"type": "response.output_item.added", "item": {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}}), "commit", "output", "response.output_item.added"),
    ("reasoning with summary commits", sse({"type": "response.output_item.added", "item": {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}}), "commit", "output", "response.output_item.added"),
    ("function_call with args commits", sse({"type": "response.output_item.added", "item": {"type": "function_call", "arguments": "{}"}}), "commit", "output", "response.output_item.added"),
    ("custom_tool_call with input commits", sse({"type": "response.output_item.added", "item": {"type": "custom_tool_call", "input": "x"}}), "commit", "output", "response.output_item.added"),
    ("non-empty content part commits", sse({"type": "response.content_part.added", "part": {"type": "output_text", "text": "x"}}), "commit", "output", "response.content_part.added"),
    ("non-textual part commits", sse({"type": "response.content_part.added", "part": {"type": "output_audio"}}), "commit", "output", "response.content_part.added"),
    ("non-empty refusal part commits", sse({"type": "response.content_part.added", "part": {"type": "refusal", "refusal": "no"}}), "commit", "output", "response.content_part.added"),
    ("non-empty summary part commits", sse({"type": "response.reasoning_summary_part.added", "part": {"type": "summary_text", "text": "x"}}), "commit", "output", "response.reasoning_summary_part.added"),
    ("completed commits", sse({"type": "response.completed", "response": {"id": "r"}}), "commit", "output", "response.completed"),
    ("invalid json commits", b"data: {not json\n\n", "commit", "not_json", None),
    ("json array commits", b"data: [1]\n\n", "commit", "not_json", None),
]

HEARTBEATS_AND_EMPTY = [
    ("comment keepalive", b": keepalive\n\n"),
    ("comment without blank line", b": keepalive\n"),
    ("keepalive event", sse({"type": "keepalive"})),
    ("empty data", b"data:\n\n"),
    ("whitespace data", b"data:    \n\n"),
    ("queued", sse({"type": "response.queued"})),
    ("rate limits", sse({"type": "codex.rate_limits", "rate_limits": {}})),
    ("metadata", sse({"type": "codex.response.metadata"})),
    ("empty message item", sse({"type": "response.output_item.added", "item": {"type": "message", "content": []}})),
    ("message with empty text parts", sse({"type": "response.output_item.added", "item": {"type": "message", "content": [{"type": "output_text", "text": ""}, {"type": "refusal", "refusal": ""}]}})),
    ("empty reasoning", sse({"type": "response.output_item.added", "item": {"type": "reasoning", "summary": []}})),
    ("empty function_call", sse({"type": "response.output_item.added", "item": {"type": "function_call", "arguments": "", "name": "f"}})),
    ("empty custom_tool_call", sse({"type": "response.output_item.added", "item": {"type": "custom_tool_call", "input": ""}})),
    ("empty output_text part", sse({"type": "response.content_part.added", "part": {"type": "output_text", "text": ""}})),
    ("empty reasoning_text part", sse({"type": "response.content_part.added", "part": {"type": "reasoning_text", "text": ""}})),
    ("empty refusal part", sse({"type": "response.content_part.added", "part": {"type": "refusal", "refusal": ""}})),
    ("empty summary part", sse({"type": "response.reasoning_summary_part.added", "part": {"type": "summary_text", "text": ""}})),
]


@pytest.mark.parametrize("name,tail,verdict,reason,trigger", TABLE, ids=[t[0] for t in TABLE])
@pytest.mark.parametrize("chunk", [None, 1])
def test_decisions(rules, name, tail, verdict, reason, trigger, chunk):
    data = HANDSHAKE + tail
    d, released, _ = run(rules, data, chunk=chunk)
    assert (d.verdict.value, d.reason, d.trigger) == (verdict, reason, trigger)
    if verdict == "failover":
        assert released == []
        assert d.error is not None
    else:
        assert b"".join(e.raw for e in released) == data  # everything, in order, exactly once


@pytest.mark.parametrize("name,beat", HEARTBEATS_AND_EMPTY, ids=[h[0] for h in HEARTBEATS_AND_EMPTY])
def test_bufferable_events_keep_the_window_open(rules, name, beat):
    d, released, clf = run(rules, HANDSHAKE + beat * 3)
    assert d.verdict is Verdict.HOLD
    assert released == []
    d, released, _ = run(rules, HANDSHAKE + beat * 3 + sse(nested_error("server_is_overloaded")))
    assert d.verdict is Verdict.FAILOVER


def test_overload_error_then_eof_is_failover(rules):
    d, _, clf = run(rules, HANDSHAKE + sse(nested_error("slow_down", "x", "y")), eof=True)
    assert (d.verdict, d.reason) == (Verdict.FAILOVER, "slow_down")
    assert clf.end().verdict is Verdict.FAILOVER


def test_clean_eof_with_only_handshake_is_its_own_reason(rules):
    d, released, _ = run(rules, HANDSHAKE, eof=True)
    assert (d.verdict, d.reason, released) == (Verdict.FAILOVER, "closed_before_output", [])
    d, _, _ = run(rules, b"", eof=True)
    assert d.reason == "closed_before_output"


def test_error_object_is_kept_for_the_shell(rules):
    d, _, _ = run(rules, HANDSHAKE + sse(nested_error("usage_limit_reached", "usage_limit_reached", "m") | {}))
    assert d.error["code"] == "usage_limit_reached"
    flat = sse({"type": "error", "code": "server_is_overloaded", "message": "m", "sequence_number": 3})
    d, _, _ = run(rules, flat)
    assert d.error == {"code": "server_is_overloaded", "message": "m"}


def test_after_commit_events_pass_through(rules):
    clf = BootstrapClassifier(rules)
    evs = events_of(HANDSHAKE + sse({"type": "response.output_text.delta"}) + sse(nested_error("server_is_overloaded")))
    decisions = [clf.feed(e) for e in evs]
    assert [d.verdict for d in decisions] == [Verdict.HOLD, Verdict.HOLD, Verdict.COMMIT, Verdict.COMMIT]
    assert decisions[-1].release == (evs[-1],)  # a rejection after the commit is delivered in-stream


# -- budgets --------------------------------------------------------------------------------

THREE_LINE = sse({"type": "response.in_progress"})  # event:, data:, blank = 3 frames


@pytest.mark.parametrize(
    "unit,frames_each",
    [(THREE_LINE, 3), (b": keepalive\n\n", 2), (b": keepalive\n", 1), (b"data:\r\n\r\n", 2)],
    ids=["3-line events", "comment+blank", "comment without blank", "crlf empty data"],
)
def test_frame_budget_boundary(rules, unit, frames_each):
    fits = 48 // frames_each
    d, released, clf = run(rules, unit * fits)
    assert d.verdict is Verdict.HOLD
    assert clf.held_frames == fits * frames_each
    d, released, clf = run(rules, unit * (fits + 1))
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "frame_budget")
    assert b"".join(e.raw for e in released) == unit * (fits + 1)  # the tripping frame is delivered


def test_frame_budget_is_checked_before_a_rejection_is_admitted(rules):
    fill = b": k\n" * 47
    d, _, _ = run(rules, fill + sse(nested_error("server_is_overloaded")))  # 47 + 3 > 48
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "frame_budget")
    d, _, _ = run(rules, b": k\n" * 45 + sse(nested_error("server_is_overloaded")))  # 45 + 3 = 48
    assert d.verdict is Verdict.FAILOVER


def test_byte_budget_boundary(rules):
    unit = THREE_LINE
    limit = len(unit) * 4
    d, _, clf = run(rules, unit * 4, max_bytes=limit)
    assert d.verdict is Verdict.HOLD
    assert clf.held_bytes == limit
    d, released, _ = run(rules, unit * 5, max_bytes=limit)
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "byte_budget")
    assert len(released) == 5


def test_one_oversized_frame_is_not_admitted(rules):
    big = sse({"type": "response.in_progress", "pad": "x" * 2000})
    d, released, clf = run(rules, big, max_bytes=1000)
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "byte_budget")
    assert clf.held_bytes == 0
    assert [e.raw for e in released] == [big]


def test_budgets_from_rules_file(rules):
    assert (rules.max_frames, rules.max_bytes) == (48, 1024 * 1024)


# -- time budget ----------------------------------------------------------------------------

def test_timeout_commits_without_a_frame(rules):
    clock = Clock(100.0)
    clf = BootstrapClassifier(rules, timeout=30, clock=clock)
    for ev in events_of(HANDSHAKE):
        assert clf.feed(ev).verdict is Verdict.HOLD
    clock.now += 29.999
    assert clf.tick().verdict is Verdict.HOLD
    clock.now += 0.001
    d = clf.tick()
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "timeout")
    assert b"".join(e.raw for e in d.release) == HANDSHAKE


def test_rejection_after_timeout_is_delivered_in_stream(rules):
    clock = Clock(100.0)
    clf = BootstrapClassifier(rules, timeout=5, clock=clock)
    clf.feed(events_of(sse(CREATED))[0])
    clock.now += 6
    rejection = events_of(sse(nested_error("server_is_overloaded")))[0]
    d = clf.feed(rejection)
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "timeout")
    assert d.release[-1] is rejection


def test_zero_timeout_is_unlimited(rules):
    clock = Clock(100.0)
    clf = BootstrapClassifier(rules, timeout=0, clock=clock)
    clock.now += 10**9
    assert clf.tick().verdict is Verdict.HOLD
    assert clf.deadline is None


# -- WebSocket messages ---------------------------------------------------------------------

def ws_run(rules, messages):
    clf = BootstrapClassifier(rules)
    for m in messages:
        d = clf.feed(Event.from_ws_message(json.dumps(m) if isinstance(m, dict) else m))
        if d.final:
            return d, clf
    return clf.tick(), clf


@pytest.mark.parametrize(
    "fixture,verdict,reason",
    [
        ("server_error_server_is_overloaded_503.json", "failover", "overloaded"),
        ("server_error_server_is_overloaded_no_status.json", "failover", "overloaded"),
        ("server_error_usage_limit_reached_429.json", "failover", "usage_limit"),
        ("server_error_invalid_request_400.json", "deliver", "terminal_error"),
        ("server_error_cyber_policy_400.json", "deliver", "terminal_error"),
        ("server_response_failed_server_is_overloaded.json", "failover", "overloaded"),
        ("server_response_failed_invalid_prompt.json", "deliver", "terminal_error"),
    ],
)
def test_ws_fixtures(rules, fixture, verdict, reason):
    msg = json.loads((WIRE / "ws" / fixture).read_text())
    d, _ = ws_run(rules, [{"type": "response.created", "response": {}}, {"type": "codex.rate_limits"}, msg])
    assert (d.verdict.value, d.reason) == (verdict, reason)


def test_ws_wrapped_error_status_decides_when_body_does_not(rules):
    d, _ = ws_run(rules, [{"type": "error", "status": 529, "error": {"type": "x", "message": "busy"}}])
    assert (d.verdict, d.reason) == (Verdict.FAILOVER, "overloaded")
    d, _ = ws_run(rules, [{"type": "error", "status": 429, "error": {"message": "slow"}}])
    assert d.reason == "rate_limited"


def test_ws_empty_messages_count_against_the_frame_budget(rules):
    d, clf = ws_run(rules, [""] * 49)
    assert (d.verdict, d.reason) == (Verdict.COMMIT, "frame_budget")
    assert clf.held_frames == 48


def test_ws_success_sequence_commits(rules):
    lines = (WIRE / "ws" / "server_success_sequence.jsonl").read_text().splitlines()
    d, _ = ws_run(rules, [json.loads(x) for x in lines if x.strip()])
    assert d.verdict is Verdict.COMMIT


# -- shared and live fixtures ---------------------------------------------------------------

FIXTURE_VERDICTS = {
    "codex_cli_responses_fixture.sse": ("commit", "output"),
    "overload_error_event_then_eof.sse": ("failover", "overloaded"),
    "overload_error_then_response_failed.sse": ("failover", "overloaded"),
    "overload_response_failed_minimal.sse": ("failover", "overloaded"),
    "overload_text_as_output_text_delta.sse": ("commit", "output"),
    "response_failed_context_length_exceeded.sse": ("deliver", "terminal_error"),
    "response_failed_cyber_policy.sse": ("deliver", "terminal_error"),
    "response_failed_insufficient_quota.sse": ("deliver", "terminal_error"),
    "response_failed_invalid_prompt.sse": ("deliver", "terminal_error"),
    "response_failed_rate_limit_exceeded.sse": ("failover", "rate_limited"),
    "response_failed_slow_down.sse": ("failover", "slow_down"),
    "response_incomplete_max_output_tokens.sse": ("deliver", "incomplete"),
    "server_error_error_then_response_failed.sse": ("failover", "server_error_retryable"),
    "synth_full_turn_reasoning_then_message.sse": ("commit", "output"),
    "synth_function_call_turn.sse": ("commit", "output"),
    "truncated_after_partial_text.sse": ("commit", "output"),
    "server_sse_overload_a.sse": ("failover", "overloaded"),
    "server_sse_cut_d.sse": ("failover", "closed_before_output"),
    "server_sse_success_full.sse": ("commit", "output"),
    "server_sse_success_minimal.sse": ("commit", "output"),
}


@pytest.mark.parametrize("name", sorted(FIXTURE_VERDICTS))
def test_fixture_streams(rules, name):
    path = WIRE / "sse" / name if (WIRE / "sse" / name).exists() else LIVE / name
    for chunk in (None, 1, 17):
        d, _, _ = run(rules, path.read_bytes(), eof=True, chunk=chunk)
        assert (d.verdict.value, d.reason) == FIXTURE_VERDICTS[name]


# -- property: the verdict does not depend on chunking -------------------------------------

_UNITS = [
    sse(CREATED), sse(IN_PROGRESS), b": keepalive\n\n", b": k\r\n", b"data:\n\n",
    sse({"type": "response.output_item.added", "item": {"type": "message", "content": []}}),
    sse({"type": "response.output_text.delta", "delta": "x"}),
    sse(nested_error("server_is_overloaded")), sse(failed("invalid_prompt")),
    b'data: {"type":"response.in_progress"}data: {"type":"keepalive"}\r\n\r\n',
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_UNITS), max_size=30), st.integers(1, 64), st.booleans())
def test_verdict_independent_of_chunking(rules, units, chunk, eof):
    data = b"".join(units)
    whole, rel_whole, clf_whole = run(rules, data, eof=eof)
    piecewise, rel_piece, clf_piece = run(rules, data, eof=eof, chunk=chunk)
    assert (whole.verdict, whole.reason, whole.trigger) == (piecewise.verdict, piecewise.reason, piecewise.trigger)
    assert rel_whole == rel_piece
    assert (clf_whole.held_frames, clf_whole.held_bytes) == (clf_piece.held_frames, clf_piece.held_bytes)
    if whole.verdict in (Verdict.COMMIT, Verdict.DELIVER):
        assert b"".join(e.raw for e in rel_whole) == data


# -- what is an event stream (core/codex_request.held_as_stream) -------------------------------------

@pytest.mark.parametrize("status,ctype,streams,held", [
    (200, "text/event-stream", False, True),
    (200, "text/event-stream; charset=utf-8", True, True),
    (200, None, True, True),  # the real backend's SSE without a Content-Type
    (200, "", True, True),
    (200, "application/octet-stream", True, True),  # a wrong label
    (200, "text/plain", True, True),
    (200, None, False, False),  # a request that did not ask to stream: read whole
    (200, "application/json", True, False),  # a JSON answer is what it says
    (200, "application/json; charset=utf-8", True, False),
    (200, "text/html", True, False),
    (503, None, True, False),  # a rejection is read whole and classified
    (429, "text/event-stream", True, False),
])
def test_an_answer_is_held_as_a_stream_by_what_it_is(status, ctype, streams, held):
    from codex_failover.core.codex_request import held_as_stream

    assert held_as_stream(status, ctype, streams) is held
