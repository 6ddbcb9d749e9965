"""The dashboard's pure parts: the activity since start (core/activity.py), the view model each row of
the page shows (core/dashboard.py), and when each account's usage is asked (core/usage_poll.py).
The page itself, in a browser: tests/test_dashboard_browser.py."""

from __future__ import annotations

import pytest

from codex_failover.core import dashboard
from codex_failover.core.activity import SSE, WEBSOCKET, Activity, session_tag, usage_tokens
from codex_failover.core.provenance import SseArtifacts
from codex_failover.core.usage_poll import UsagePoll

NOW = 1_800_000_000.0


def hhmm(at: float) -> str:
    return f"t+{int(at - NOW)}"


# -- activity ----------------------------------------------------------------------------------


def test_a_session_tag_is_short_stable_and_not_the_id():
    assert session_tag("019a-session") == session_tag("019a-session")
    assert len(session_tag("019a-session")) == 4 and session_tag("019a-session") not in "019a-session"
    assert session_tag("a") != session_tag("b")
    assert session_tag(None) == session_tag("") == "-"


@pytest.mark.parametrize("payload, tokens", [
    ({"type": "response.completed", "response": {"usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}}},
     {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}),
    ({"type": "response.completed", "response": {"usage": {"input_tokens": "x", "output_tokens": True}}}, None),
    ({"type": "response.completed", "response": {}}, None),
    ({"type": "response.created", "response": {"usage": {"input_tokens": 1}}}, None),
    ([], None),
])
def test_tokens_come_from_response_completed_only(payload, tokens):
    assert usage_tokens(payload) == tokens


def test_the_sse_artifacts_keep_the_completed_events_tokens():
    made = SseArtifacts()
    made.feed(b'data: {"type":"response.created","response":{"id":"r1"}}\n\n')
    assert made.tokens is None
    made.feed(b'data: {"type":"response.completed","response":{"id":"r1","output":[],'
              b'"usage":{"input_tokens":12,"output_tokens":3,"total_tokens":15}}}\n\n')
    assert made.tokens == {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15}


# Each row: the attempts of one request, then what the counts say.
@pytest.mark.parametrize("tries, outcome, served, moved, not_served, rejections", [
    ([("own", "commit", "output")], None, 1, 0, 0, {}),
    ([("own", "failover", "overloaded"), ("spare", "commit", "output")], None, 1, 1, 0, {"overloaded": 1}),
    ([("own", "failover", "usage_limit"), ("a", "failed", "pre_dispatch"), ("b", "deliver", "client_error")], None,
     1, 1, 0, {"usage_limit": 1, "pre_dispatch": 1}),
    ([("own", "recover", "transport_error"), ("own", "commit", "output")], None, 1, 0, 0, {"transport_error": 1}),
    ([("own", "failover", "overloaded"), ("spare", "failover", "overloaded")], "exhausted -> 503", 0, 0, 1,
     {"overloaded": 2}),
    ([("own", "cancelled", "client_gone")], None, 0, 0, 0, {}),
])
def test_the_counts_since_start(tries, outcome, served, moved, not_served, rejections):
    activity = Activity()
    record = activity.start("k3x9-r1", NOW, "sess", "gpt-5", SSE)
    for credential, verdict, reason in tries:
        activity.attempt(record, credential, verdict, reason)
    if outcome:
        activity.answered(record, outcome)
    assert activity.counts() == {"requests": 1, "served": served, "moved_away": moved, "not_served": not_served,
                                 "rejections": rejections}


def test_the_ring_is_bounded():
    activity = Activity(size=3)
    for n in range(5):
        activity.start(f"r{n}", NOW + n, None, "m", SSE)
    assert [r.request_id for r in activity.recent] == ["r2", "r3", "r4"]
    assert activity.requests == 5


# -- the view model ----------------------------------------------------------------------------


def report(**over) -> dict:
    base = {
        "pool": "/home/u/pool.yaml",
        "credentials": [
            {"name": "work", "kind": "chatgpt", "base_url": "https://chatgpt.com/backend-api/codex", "route": "direct",
             "state": "cooling", "reason": "overloaded", "cooling_for_s": 42.0, "usage": "",
             "usage_windows": [{"window": "primary", "used_percent": 37.5, "resets_at": NOW + 7200},
                               {"window": "secondary", "used_percent": 100, "resets_at": NOW + 3 * 86400}],
             "token_expires_in_s": 5 * 86400, "refresh": "CODEX_HOME=~/.codex-work codex login"},
            {"name": "spare", "kind": "apikey", "base_url": "https://api.openai.com/v1", "route": "direct",
             "state": "ready", "reason": None, "usage": "usage unknown", "usage_windows": []},
            {"name": "old", "kind": "chatgpt", "base_url": "x", "route": "direct", "state": "expired",
             "reason": "refresh it: codex login", "usage_windows": [], "token_expires_in_s": -5},
            {"name": "bad", "kind": "apikey", "base_url": "x", "route": "direct", "state": "out",
             "reason": "HTTP 401 auth_rejected", "usage_windows": [],
             "cooldown_ended": {"how": "ended by hand", "was": "overloaded", "s_ago": 120}},
        ],
        "clients": [{"label": "account …1a2b", "kind": "chatgpt", "seen_s_ago": 30, "state": "cooling",
                     "reason": "usage_limit", "cooling_for_s": 3600.0,
                     "usage_windows": [{"window": "primary", "used_percent": 100, "resets_at": NOW + 3600}]}],
        "routes": [{"endpoint": "corp[1]=http://proxy-a:3128", "state": "up"},
                   {"endpoint": "corp[2]=http://proxy-b:3128", "state": "backing off 20s more (failed 2x: refused)"}],
        "held_requests": 1, "attempts_in_flight": 2, "websockets": [{"id": "k3x9-w1"}],
        "relay_port": 40000, "relay_unclaimed": 0, "artifacts_known": 12, "recovery_buffering": 0,
        "counts": {"requests": 3},
    }
    base.update(over)
    return base


def rows() -> dict[str, dict]:
    asked = {"spare": "usage answered HTTP 404 at 12:00", "account …1a2b": "usage asked at 12:01"}
    return {r["name"]: r for r in dashboard.credential_rows(report(), NOW, asked, hhmm)}


@pytest.mark.parametrize("name, field, says", [
    ("work", "badge", "rest"),
    ("work", "why", "resting: overloaded"),
    ("work", "rest_left", "42 s"),
    ("work", "token", "token expires in 5.0 days"),
    ("work", "resettable", True),
    ("spare", "badge", "ok"),
    ("spare", "why", "in rotation"),
    ("spare", "windows", []),
    ("spare", "usage_note", "usage answered HTTP 404 at 12:00"),
    ("spare", "resettable", False),
    ("spare", "token", None),
    ("old", "badge", "out"),
    ("old", "why", "token expired; refresh it: codex login"),
    ("old", "token", None),
    ("old", "usage_note", "usage not asked while it rests"),
    ("bad", "why", "out of rotation: HTTP 401 auth_rejected"),
    ("bad", "resettable", True),
    ("bad", "ended", "cooldown ended 2 min ago (ended by hand)"),
    ("own account (account …1a2b)", "own", True),
    ("own account (account …1a2b)", "why", "resting: usage_limit"),
    ("own account (account …1a2b)", "rest_left", "1.0 h"),
    ("own account (account …1a2b)", "resettable", True),
    ("own account (account …1a2b)", "reset", "1a2b"),
    ("work", "reset", "work"),
    ("own account (account …1a2b)", "seen", "last request 0 min ago"),
    ("own account (account …1a2b)", "usage_note", "usage asked at 12:01"),
])
def test_what_each_account_row_says(name, field, says):
    assert rows()[name][field] == says


def test_usage_windows_are_bars_with_their_reset_times():
    work = rows()["work"]["windows"]
    assert work == [
        {"label": "5-hour", "percent": 37.5, "text": "37.5% used", "resets": "resets t+7200 (in 2.0 h)", "full": False},
        {"label": "weekly", "percent": 100.0, "text": "100% used", "resets": "resets t+259200 (in 3.0 days)",
         "full": True}]
    odd = dashboard.credential_rows(report(credentials=[{**report()["credentials"][1], "usage_windows": [
        {"window": "primary", "used_percent": 140, "resets_at": None},
        {"window": "secondary", "used_percent": 3, "resets_at": NOW - 5}]}], clients=[]), NOW, {}, hhmm)[0]["windows"]
    assert [(w["percent"], w["resets"]) for w in odd] == [(100.0, "reset time unknown"), (3.0, "reset due")]


def test_the_routes_counts_and_internals():
    activity = Activity()
    r = activity.start("k3x9-r1", NOW, "s", "gpt-5", SSE)
    activity.attempt(r, "own", "failover", "overloaded")
    activity.attempt(r, "spare", "commit", "output")
    view = dashboard.view(report(), activity, NOW, {}, hhmm)
    assert [(r["ok"], r["state"]) for r in view["routes"]] == [
        (True, "up"), (False, "backing off 20s more (failed 2x: refused)")]
    assert {c["label"]: c["value"] for c in view["counts"]} == {
        "requests": 1, "served": 1, "moved away": 1, "not served": 0, "held now": 1, "websockets open": 1}
    assert view["rejections"] == [{"reason": "overloaded", "count": 1}]
    assert view["internals"] == {"relay_port": 40000, "relay_unclaimed": 0, "artifacts_known": 12,
                                 "recovery_buffering": 0}
    assert view["pool"] == "/home/u/pool.yaml"
    assert dashboard.view(report(pool=None), Activity(), NOW)["pool"].startswith("(no pool file")


def test_the_recent_requests_newest_first_with_each_attempt():
    activity = Activity()
    first = activity.start("k3x9-r1", NOW, "sess-1", "gpt-5-codex", SSE)
    activity.attempt(first, "own", "failover", "overloaded")
    activity.attempt(first, "spare", "commit", "output")
    activity.first_output(first, 412.7)
    first.tokens_from = lambda: {"input_tokens": 12000, "output_tokens": 300, "total_tokens": 12300}
    second = activity.start("k3x9-w1-t2", NOW + 5, "sess-2", None, WEBSOCKET)
    activity.attempt(second, "own", "failover", "usage_limit")
    activity.answered(second, "exhausted -> 429")
    third = activity.start("k3x9-r2", NOW + 6, None, "gpt-5", SSE)
    got = dashboard.request_rows(activity.recent, hhmm)
    assert [(r["id"], r["time"], r["model"], r["transport"], r["result"]) for r in got] == [
        ("k3x9-r2", "t+6", "gpt-5", "sse", "in progress"),
        ("k3x9-w1-t2", "t+5", "-", "websocket", "exhausted -> 429"),
        ("k3x9-r1", "t+0", "gpt-5-codex", "sse", "served by spare (moved)")]
    r1 = got[2]
    assert r1["session"] == session_tag("sess-1") and got[0]["session"] == "-"
    assert [a["text"] for a in r1["attempts"]] == ["own: failover (overloaded)", "spare: commit"]
    assert [a["ok"] for a in r1["attempts"]] == [False, True]
    assert (r1["first_output"], r1["tokens"], r1["moved"]) == ("412 ms", "12.0k in / 300 out", True)
    assert (got[1]["first_output"], got[1]["tokens"], got[1]["ok"]) == ("", "", False)
    assert third.tries == []


# -- when usage is asked -----------------------------------------------------------------------


def test_usage_is_asked_only_while_the_dashboard_is_open():
    poll = UsagePoll()
    assert poll.due([("a", "ready")], NOW) == []
    poll.watched(NOW)
    assert poll.due([("a", "ready")], NOW) == ["a"]
    assert poll.due([("a", "ready")], NOW + 601) == []  # nobody looked for 10 minutes


@pytest.mark.parametrize("state", ["cooling", "out", "expired"])
def test_a_resting_or_expired_account_is_never_asked(state):
    poll = UsagePoll()
    poll.watched(NOW)
    assert poll.due([("a", state), ("b", "ready")], NOW) == ["b"]


def test_each_account_at_a_modest_interval_and_sooner_after_a_rejection():
    poll = UsagePoll()
    poll.watched(NOW)
    accounts = [("a", "ready"), ("b", "ready")]
    for key in poll.due(accounts, NOW):
        poll.asked(key, NOW)
    poll.watched(NOW + 200)
    assert poll.due(accounts, NOW + 200) == []
    poll.rejection(NOW + 30)
    assert poll.due(accounts, NOW + 59) == []  # never twice within a minute
    poll.watched(NOW + 60)
    assert poll.due(accounts, NOW + 60) == ["a", "b"]
    for key in ("a", "b"):
        poll.asked(key, NOW + 60)
    assert poll.due(accounts, NOW + 200) == []  # that rejection was answered
    poll.watched(NOW + 360)
    assert poll.due(accounts, NOW + 360) == ["a", "b"]  # five minutes on


def test_a_round_is_bounded_oldest_asked_first():
    poll = UsagePoll(per_round=2)
    poll.watched(NOW)
    poll.asked("c", NOW - 400)
    poll.asked("a", NOW - 500)
    assert poll.due([("a", "ready"), ("b", "ready"), ("c", "ready")], NOW) == ["b", "a"]
    poll.forget(["b"])
    assert poll.due([("a", "ready"), ("b", "ready")], NOW) == ["a", "b"]


# -- a gated socket's turns on the dashboard (ws/socket_story.py) --------------------------------


def test_a_sockets_turns_are_listed_its_warm_up_is_not(caplog):
    import json
    import logging
    from collections import deque
    from types import SimpleNamespace

    from codex_failover.ws.socket_story import SocketStory

    activity = Activity()
    flow = SimpleNamespace(comment="")
    story = SocketStory("k3x9-w1", flow, deque(maxlen=20), activity, "fp/session-1")
    up = SimpleNamespace(cand=SimpleNamespace(name="primary"), route="direct",
                         leg=SimpleNamespace(judge_socket=lambda mark, line: None))
    warmup = SimpleNamespace(n=1, warmup=True, movable=True, why_pinned=None, body={"model": "gpt-5", "generate": False})
    turn = SimpleNamespace(n=2, warmup=False, movable=True, why_pinned=None, body={"model": "gpt-5-codex"})
    with caplog.at_level(logging.INFO, logger="codex_failover"):
        story.turn(warmup, "primary")
        story.attempt(up, warmup, "commit", "output")
        story.turn(turn, "primary")
        story.attempt(up, turn, "failover", "overloaded")
        up.cand.name = "spare"
        story.attempt(up, turn, "commit", "output")
        story.message(json.dumps({"type": "response.completed", "response": {
            "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}}).encode())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert lines == [f"[k3x9-w1] turn 2 credential=primary route=direct verdict=failover reason=overloaded "
                     f"session={session_tag('fp/session-1')}",
                     f"[k3x9-w1] turn 2 credential=spare route=direct verdict=commit reason=output "
                     f"session={session_tag('fp/session-1')}"]
    [row] = dashboard.request_rows(activity.recent, hhmm)
    assert (row["id"], row["model"], row["transport"], row["result"], row["tokens"]) == (
        "k3x9-w1-t2", "gpt-5-codex", "websocket", "served by spare (moved)", "7 in / 2 out")
    assert flow.comment.splitlines()[0] == "websocket k3x9-w1: turn 2: spare via direct: commit (output)"
    assert all(line.startswith("• turn ") for line in flow.comment.splitlines()[1:])
