"""Unit tests: the marks, comments and errors mitmweb shows for a failover (story.py). Pure."""

from __future__ import annotations

import time

import pytest
from mitmproxy.utils import emoji

from codex_failover.core import story
from codex_failover.core.story import AttemptLog


@pytest.mark.parametrize("verdict, reason, ok, mark", [
    ("commit", "output", True, ":white_check_mark:"),
    ("deliver", "status_200", True, ":white_check_mark:"),
    ("failover", "overloaded", False, ":x:"),
    ("recover", "no_terminal", False, ":arrows_counterclockwise:"),
    ("cancelled", "client_gone", False, ":no_entry_sign:"),
    ("failed", "response_timeout", False, ":hourglass:"),
    ("failed", "incomplete_response", False, ":hourglass:"),
    ("failed", "pre_dispatch", False, ":electric_plug:"),
    ("failed", "tls_failed", False, ":electric_plug:"),
])
def test_marks_are_shortcodes_mitmweb_renders(verdict, reason, ok, mark):
    assert story.mark(verdict, reason, ok) == mark
    assert mark in emoji.emoji  # mitmweb shows anything else as a red circle


@pytest.mark.parametrize("verdict, reason, error", [
    ("failover", "overloaded", "codex-failover: rejected: overloaded"),
    ("cancelled", "client_gone", "codex-failover: cancelled: client_gone"),
    ("failed", "pre_dispatch", "codex-failover: failed: pre_dispatch"),
    ("recover", "transport", "codex-failover: retried: transport"),
])
def test_a_losers_error_names_the_verdict(verdict, reason, error):
    assert story.attempt_error(verdict, reason) == error


def entry(n, cred, verdict, reason, ms=40, status=200):
    return AttemptLog(n, cred, verdict, reason, ms, status)


def test_the_client_flow_tells_the_whole_request():
    until = time.mktime((2026, 11, 30, 7, 10, 3, 0, 0, -1))
    history = [entry(1, "client", "failover", "overloaded", 45), entry(2, "spare-2", "commit", "output", 84)]
    skipped = {"work": story.Skipped("work", "cooling", until, "usage_limit"),
               "old": story.Skipped("old", "out", None, "auth_rejected"),
               "client": story.Skipped("client", "cooling", until, "overloaded")}  # tried: not listed as skipped
    text = story.request_comment(history, skipped, None, request_id="r4")
    assert text.splitlines() == [
        "failover: 2 attempts, served by spare-2 after overloaded",
        "• r4 attempt 1: client via direct: failover (overloaded), HTTP 200, 45 ms",
        "• r4 attempt 2: spare-2 via direct: commit (output), HTTP 200, 84 ms",
        "• work: skipped, cooling until 07:10:03 (usage_limit)",
        "• old: skipped, out of rotation (auth_rejected)",
    ]


@pytest.mark.parametrize("history, outcome, first", [
    ([entry(1, "client", "commit", "output")], None, "failover: 1 attempt, served by client"),
    ([entry(1, "a", "failover", "overloaded"), entry(2, "b", "failover", "rate_limited")], "exhausted -> 429",
     "failover: 2 attempts, exhausted -> 429"),
    ([], "every credential cooling or out -> 503 (not dialled)",
     "failover: 0 attempts, every credential cooling or out -> 503 (not dialled)"),
    ([entry(1, "a", "failover", "overloaded")], None, "failover: 1 attempt so far after overloaded"),
])
def test_summary_line(history, outcome, first):
    assert story.request_comment(history, {}, None, outcome).splitlines()[0] == first


def test_attempt_comment_names_attempt_credential_route_verdict_reason_and_time():
    e = AttemptLog(2, "spare", "failover", "overloaded", 45, 200, "http://proxy-a:3128")
    assert story.attempt_comment("r7", e, 3) == (
        "attempt 2/3: spare via http://proxy-a:3128: failover (overloaded), HTTP 200, 45 ms (codex-failover r7)")


def test_a_skipped_credential_says_why_and_for_how_long():
    from codex_failover.core.health import State
    from codex_failover.core.story import skipped_line

    assert skipped_line("client", "cooling", State("cooling", 1000 + 3571, "usage_limit"), 1000) == \
        "client cooling (usage_limit, 59m left)"
    assert skipped_line("work", "cooling", State("cooling", 1000 + 7300, "usage_limit"), 1000) == \
        "work cooling (usage_limit, 2h01m left)"
    assert skipped_line("spare", "out", State("out", None, "HTTP 401"), 0) == "spare out (HTTP 401)"
    assert skipped_line("x", "expired", State("ready"), 0) == "x expired"
