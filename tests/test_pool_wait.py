"""The answers for "nothing can serve" tell the time: the soonest recovery (pool_wait), and the
fields and status the client answers carry (client_answers), on an injected clock."""

import json

import pytest

from codex_failover.core.health import Health
from codex_failover.core.outcomes import Rejection
from codex_failover.core.pool_wait import back_in, retry_after, soonest, time_fields
from codex_failover.mitm import client_answers

NOW = 1_800_000_000.0


def health(**cooling) -> Health:
    h = Health(clock=lambda: NOW)
    for key, (seconds, reason) in cooling.items():
        h.cool(key, seconds, reason)
    return h


@pytest.mark.parametrize("cooling,keys,want", [
    ({}, ["a"], None),
    ({"a": (60, "overloaded")}, ["a", "b"], ("overloaded", 60, None)),
    ({"a": (60, "overloaded"), "b": (3600, "usage_limit")}, ["a", "b"], ("overloaded", 60, NOW + 3600)),
    ({"a": (7200, "usage_window_full"), "b": (3600, "usage_limit")}, ["a", "b"], ("usage_limit", 3600, NOW + 3600)),
    ({"a": (30, "overloaded"), "z": (5, "overloaded")}, ["a"], ("overloaded", 30, None)),  # only the request's keys
])
def test_soonest(cooling, keys, want):
    found = soonest(health(**cooling), keys)
    got = None if found is None else (found.reason, found.seconds, found.usage_at)
    assert got == want


def test_out_of_rotation_never_counts():
    h = health()
    h.take_out("a", "HTTP 401")
    assert soonest(h, ["a"]) is None


@pytest.mark.parametrize("waits,cap,want", [
    ([60.0, 90.0], 5.0, None),       # later than the cap: no promise
    ([3.2, 90.0], 5.0, 4),           # within it: the truth, rounded up
    ([0.0, 90.0], 5.0, 1),           # one is ready now
    ([None], 5.0, None),             # out of rotation only
    ([2.0], 0.0, None),              # the header is off
])
def test_retry_after_only_when_true(waits, cap, want):
    assert retry_after(waits, cap) == want


def test_time_fields_for_a_usage_limit_and_an_overload():
    found = soonest(health(a=(3600, "usage_limit"), b=(120, "overloaded")), ["a", "b"])
    assert time_fields(found, usage_limit=True) == {"retry_after_seconds": 120, "resets_at": int(NOW) + 3600,
                                                    "resets_in_seconds": 3600}
    assert time_fields(found, usage_limit=False) == {"retry_after_seconds": 120}
    assert "back in 2 min" in back_in(found) and "UTC" in back_in(found)
    assert time_fields(None, True) == {}


def body(response):
    return response.status_code, response.headers.get("retry-after"), json.loads(response.content)["error"]


def test_all_cooling_on_usage_limits_is_429_usage_limit_reached_with_the_soonest_reset():
    found = soonest(health(a=(7200, "usage_limit"), b=(3600, "usage_window_full")), ["a", "b"])
    status, header, error = body(client_answers.all_cooling(
        [("a", "cooling", "usage_limit"), ("b", "cooling", "usage_window_full")], None, None, found))
    assert (status, header) == (429, None)
    assert (error["type"], error["code"]) == ("usage_limit_reached", "usage_limit_reached")
    assert error["resets_at"] == int(NOW) + 3600 and error["resets_in_seconds"] == 3600


def test_all_cooling_on_overloads_is_503_saying_when_without_a_false_retry_after():
    found = soonest(health(a=(120, "overloaded"), b=(300, "overloaded")), ["a", "b"])
    status, header, error = body(client_answers.all_cooling(
        [("a", "cooling", "overloaded"), ("b", "cooling", "overloaded")], None, None, found))
    assert (status, header, error["code"]) == (503, None, "server_is_overloaded")
    assert error["retry_after_seconds"] == 120 and "resets_at" not in error
    assert "back in 2 min" in error["message"]


def test_all_cooling_speaks_for_the_cooldown_that_ends_first():
    found = soonest(health(a=(90, "overloaded"), b=(3600, "usage_limit")), ["a", "b"])
    status, _, error = body(client_answers.all_cooling(
        [("b", "cooling", "usage_limit"), ("a", "cooling", "overloaded")], None, None, found))
    assert (status, error["code"]) == (503, "server_is_overloaded")


def test_exhausted_on_a_usage_limit_carries_the_pools_soonest_reset_not_only_upstreams():
    found = soonest(health(a=(86400, "usage_limit"), b=(1800, "usage_limit")), ["a", "b"])
    last = Rejection("usage_limit", 429, {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                                          "resets_at": int(NOW) + 86400, "resets_in_seconds": 86400})
    status, _, error = body(client_answers.exhausted(last, [], None, None, found))
    assert (status, error["type"]) == (429, "usage_limit_reached")
    assert error["resets_at"] == int(NOW) + 1800 and error["resets_in_seconds"] == 1800


def test_exhausted_with_a_true_retry_after_sends_the_header():
    found = soonest(health(a=(3, "overloaded")), ["a"])
    last = Rejection("overloaded", 503, {"code": "server_is_overloaded", "message": "Our servers are currently overloaded."})
    status, header, error = body(client_answers.exhausted(last, [], 3, None, found))
    assert (status, header, error["retry_after_seconds"]) == (503, "3", 3)


def test_the_websocket_gates_own_error_frame_tells_the_time():
    from codex_failover.ws.dial import as_frames

    found = soonest(health(a=(3600, "usage_limit")), ["a"])
    (frame, text), = as_frames(Rejection("usage_limit", 429, {"type": "usage_limit_reached", "message": "limit"}), found)
    doc = json.loads(frame)
    assert text and doc["status"] == 429
    assert doc["error"]["resets_at"] == int(NOW) + 3600 and doc["error"]["resets_in_seconds"] == 3600
    upstream = ((b'{"type":"error"}', True),)
    assert as_frames(Rejection("usage_limit", 429, {}, frames=upstream), found) == upstream  # upstream's own, as sent
