"""Recovery policy: validation and clamping, the retry budget (exact, with a fake clock), and
which stream endings are recoverable."""

import pytest
from conftest import Clock

from codex_failover.core.recovery import (
    RecoveryConfigError,
    RecoveryPolicy,
    RetryBudget,
    parse_recovery,
    recoverable_stream_end,
)
from codex_failover.core.vocabulary import NO_TERMINAL


def test_defaults_and_a_full_section():
    assert parse_recovery(None, "r") == (RecoveryPolicy(), [])
    policy, notes = parse_recovery({"enabled": True, "attempts": 3, "max_buffer_bytes": "1MiB", "retry_window": "10s",
                                    "max_concurrent": 4, "backoff": {"initial": "100ms", "max": "1s"}, "heartbeat": 0}, "r")
    assert policy == RecoveryPolicy(True, 3, 1024 * 1024, 10.0, 4, 0.1, 1.0, 0.0)
    assert notes == []


def test_out_of_range_values_are_clamped_and_reported():
    policy, notes = parse_recovery({"attempts": 99, "max_buffer_bytes": "1KiB", "retry_window": "2h",
                                    "backoff": {"initial": "1ms", "max": "5m"}, "heartbeat": "500ms"}, "r")
    assert (policy.attempts, policy.max_buffer_bytes, policy.retry_window) == (20, 64 * 1024, 600.0)
    assert (policy.backoff_initial, policy.backoff_max, policy.heartbeat) == (0.01, 60.0, 1.0)
    assert len(notes) == 6
    assert all("using" in n for n in notes)


@pytest.mark.parametrize("doc,needle", [
    ({"enabled": "yes"}, "r.enabled"), ({"attempts": -1}, "r.attempts"), ({"retry_window": "soon"}, "r.retry_window"),
    ({"max_buffer_bytes": "lots"}, "r.max_buffer_bytes"), ({"backoff": {"initial": "x"}}, "r.backoff.initial"),
    ({"backoff": {"jitter": 1}}, "r.backoff"), ({"nope": 1}, "unknown field"), ([], "expected a mapping"),
])
def test_nonsense_is_a_clear_error(doc, needle):
    with pytest.raises(RecoveryConfigError, match=needle.replace(".", r"\.")):
        parse_recovery(doc, "r")



def test_attempt_budget_is_exact():
    budget = RetryBudget(RecoveryPolicy(attempts=2, retry_window=100), Clock(0.0), rand=lambda: 1.0)
    assert [budget.next_delay() for _ in range(3)] == [0.25, 0.5, None]


def test_window_budget_is_exact_and_backoff_doubles_to_the_cap():
    clock = Clock(0.0)
    budget = RetryBudget(RecoveryPolicy(retry_window=3.0, backoff_initial=0.5, backoff_max=1.0), clock, rand=lambda: 1.0)
    delays = []
    while (d := budget.next_delay()) is not None:
        delays.append(d)
        clock.now += d
    assert delays == [0.5, 1.0, 1.0]
    assert clock.now == 2.5  # a 4th would start at 3.5 > the 3 s window


def test_full_jitter():
    budget = RetryBudget(RecoveryPolicy(), Clock(0.0), rand=lambda: 0.5)
    assert budget.next_delay() == 0.125


@pytest.mark.parametrize("terminal,error,expected", [
    ("response.completed", None, None),
    ("response.incomplete", None, None),
    (None, None, NO_TERMINAL),
    ("response.failed", {"code": "server_error"}, "server_error"),
    ("error", {"type": "server_error", "message": "x"}, "server_error"),
    ("error", {"status": 503}, "status_503"),
    ("response.failed", {"code": "context_length_exceeded"}, None),
    ("error", {"status": 429}, None),
    ("unframed", None, None),
])
def test_recoverable_stream_endings(terminal, error, expected):
    assert recoverable_stream_end(terminal, error) == expected


def test_terminal_tracker_sees_the_end_of_a_stream():
    from codex_failover.core.framer import Event
    from codex_failover.core.recovery import TerminalTracker

    tracker = TerminalTracker()
    for payload in ['{"type":"response.output_text.delta"}', '{"type":"error","error":{"code":"server_error"}}',
                    '{"type":"response.failed","response":{"error":{"code":"server_error","message":"x"}}}']:
        tracker.see(Event.from_ws_message(payload))
    assert tracker.terminal == "response.failed"
    assert tracker.error["code"] == "server_error"
    tracker.see(Event.from_ws_message('{"type":"response.completed","response":{}}'))
    assert (tracker.terminal, tracker.error) == ("response.completed", None)
    tracker.unframed()
    assert recoverable_stream_end(tracker.terminal, tracker.error) is None


@pytest.mark.parametrize("payload, terminal", [
    ('{"type":"response.output_text.delta","delta":"hi"}', None),
    ('{"type":"response.output_text.delta","delta":"an error, in words"}', None),  # parsed: not terminal
    ('{"type":"response.completed","response":{}}', "response.completed"),
    ('{"type":"response.incomplete","response":{}}', "response.incomplete"),
    ('{"type":"error","error":{"code":"server_error"}}', "error"),
    ('{"type":"response.\\u0066ailed","response":{"error":{"code":"server_error"}}}', "response.failed"),
    ('{"type":"\\u0065rror","code":"server_error"}', "error"),
    ('{"type":"response.output_text.delta","delta":"caf\\u00e9"}', None),
])
def test_terminal_tracker_reads_what_can_be_terminal(payload, terminal):
    """Only an event whose bytes could spell a terminal type is parsed; an escaped one is still seen."""
    from codex_failover.core.framer import Event
    from codex_failover.core.recovery import TerminalTracker

    tracker, event = TerminalTracker(), Event.from_ws_message(payload)
    tracker.see(event)
    assert tracker.terminal == terminal
    assert tracker.terminal == (event.type if event.type in TerminalTracker.TERMINALS + ("error",) else None)


def test_terminal_tracker_leaves_a_delta_unparsed():
    """A stream's deltas cost a byte search, not a JSON parse (issue 27: CPU per request)."""
    from codex_failover.core import framer
    from codex_failover.core.recovery import TerminalTracker

    event = framer.Event(b'data: {"type":"response.output_text.delta","delta":"hello"}\n\n', 1)
    TerminalTracker().see(event)
    assert event._payload is framer._NOT_PARSED
