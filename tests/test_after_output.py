"""A committed response after its output began (core/after_output.py): the rule both transports follow,
and an SSE stream released at event boundaries, cut before a rejection."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from codex_failover.core.after_output import AfterOutput, LiveSse
from codex_failover.core.provenance import SseArtifacts
from codex_failover.core.vocabulary import Verdict


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DELTA = sse({"type": "response.output_text.delta", "delta": "Hi"})
REASONING_DONE = sse({"type": "response.output_item.done", "item": {"type": "reasoning", "id": "r"}})
MESSAGE_DONE = sse({"type": "response.output_item.done", "item": {"type": "message", "id": "m"}})
OVERLOAD = sse({"type": "error", "error": {"type": "server_error", "code": "server_is_overloaded",
                                           "message": "overloaded"}})
FAILED = sse({"type": "response.failed", "response": {"error": {"code": "server_is_overloaded", "message": "x"}}})
SERVER_ERROR = sse({"type": "response.failed", "response": {"error": {"code": "server_error", "message": "boom"}}})
COMPLETED = sse({"type": "response.completed", "response": {"id": "resp_1"}})


def parsed(raw: bytes):
    return lambda: json.loads(raw.split(b"data: ", 1)[1])


@pytest.mark.parametrize("before,late,cut", [
    ([DELTA], OVERLOAD, True),  # deltas only: the re-send starts the answer over
    ([DELTA], FAILED, True),
    ([DELTA, REASONING_DONE], OVERLOAD, True),  # a reasoning item is no answer the user saw
    ([DELTA, MESSAGE_DONE], OVERLOAD, False),  # a whole message is out: a re-send would repeat it
    ([DELTA], SERVER_ERROR, False),  # not a rejection the rules name: delivered as sent
    ([DELTA, COMPLETED], OVERLOAD, False),  # after the end: nothing is watched
])
def test_the_rule(rules, before, late, cut):
    rule = AfterOutput(rules)
    assert [rule.see(raw, parsed(raw)) for raw in before] == [None] * len(before)
    decision = rule.see(late, parsed(late))
    assert (decision is not None) is cut
    if cut:
        assert decision.verdict is Verdict.FAILOVER and decision.reason == "overloaded"
    assert not rule.watching  # one rejection (or the end) is all it looks for


def test_only_events_that_may_matter_are_parsed(rules):
    rule = AfterOutput(rules)

    def never():
        raise AssertionError("parsed")
    assert rule.see(DELTA, never) is None
    assert rule.see(b": keepalive\n\n", never) is None


def released(rules, held: bytes, chunks: list[bytes], watch: bool = True):
    """Frame `held` as the hold does, commit, then feed `chunks` and the end: (bytes out, cut)."""
    made = SseArtifacts()
    made.frame(held)
    live = LiveSse(made, AfterOutput(rules) if watch else None)
    out, cut = [live.held(held)], None
    for chunk in [*chunks, None]:
        step = live.feed(chunk)
        out.append(step.out)
        cut = cut or step.cut
    return b"".join(out), cut


STREAM = [sse({"type": "response.created"}), DELTA, DELTA, MESSAGE_DONE, COMPLETED]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_releases_the_stream_byte_for_byte(rules, data):
    whole = b"".join(STREAM) + b"data: unterminated"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=8)))
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    out, cut = released(rules, pieces[0], pieces[1:])
    assert out == whole and cut is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_cuts_before_the_rejection_and_never_inside_an_event(rules, data):
    before = sse({"type": "response.created"}) + DELTA + DELTA
    whole = before + OVERLOAD + FAILED + b"data: after\n\n"
    # (the held part ends before the rejection: one the hold saw is the machine's to fail over)
    cuts = sorted({data.draw(st.integers(1, len(before)))} | set(data.draw(st.lists(st.integers(1, len(whole)), max_size=8))))
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    out, cut = released(rules, pieces[0], pieces[1:])
    assert out == before and cut is not None and cut.reason == "overloaded"


def test_a_held_event_in_part_waits_for_its_rest(rules):
    made = SseArtifacts()
    held = DELTA + DELTA[:5]
    made.frame(held)
    live = LiveSse(made, AfterOutput(rules))
    assert live.held(held) == DELTA
    assert live.feed(DELTA[5:]).out == DELTA
    assert live.feed(DELTA).out == DELTA  # the usual read: one or more whole events, passed as they are


def test_with_recovery_nothing_is_cut(rules):
    out, cut = released(rules, DELTA, [OVERLOAD, FAILED], watch=False)
    assert out == DELTA + OVERLOAD + FAILED and cut is None


def test_a_stream_past_the_framers_bounds_passes_as_it_comes(rules):
    made = SseArtifacts()
    made._framer.max_line_bytes = made._framer.max_block_bytes = 64  # (small bounds for the test)
    live = LiveSse(made, AfterOutput(rules))
    assert live.held(b"") == b""
    assert live.feed(b"data: 1").out == b""  # an event still to end
    over = b"x" * 80
    assert live.feed(over).out == b"data: 1" + over  # the bounds broke: what was kept back goes out with it
    step = live.feed(b"\n\n" + OVERLOAD)
    assert step.out == b"\n\n" + OVERLOAD and step.cut is None  # nothing more is looked at
    assert live.feed(None).out == b""


def test_a_cut_stream_of_a_stated_length_is_cut_off():
    from mitmproxy import http

    from codex_failover.core.after_output import cut_off

    assert cut_off(http.Headers(content_length="120")) and cut_off({"content-length": "1"})
    assert not cut_off(http.Headers(transfer_encoding="chunked")) and not cut_off({})
