"""Cooldowns that end when the account is back (core/cooldown_end.py), on an injected clock."""

import json

import pytest
from conftest import WIRE

from codex_failover.core.cooldown_end import (
    BY_HAND,
    REDEEMED,
    CooldownEnds,
    UsageRecheck,
    redeems_reset_credit,
    usage_has_headroom,
    usage_url,
    usage_windows,
)
from codex_failover.core.health import Health

NOW = 1_800_000_000.0


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self):
        return self.now


@pytest.mark.parametrize("method,path,status,want", [
    ("POST", "/backend-api/wham/rate-limit-reset-credits/consume", 200, True),
    ("POST", "/backend-api/wham/rate-limit-reset-credits/consume?x=1", 204, True),
    ("post", "/backend-api/wham/rate-limit-reset-credits/consume/", 200, True),
    ("POST", "/backend-api/wham/rate-limit-reset-credits/consume", 402, False),   # not redeemed
    ("GET", "/backend-api/wham/rate-limit-reset-credits/consume", 200, False),
    ("POST", "/backend-api/wham/rate-limit-reset-credits", 200, False),          # the list, not a redemption
])
def test_redeems_reset_credit(method, path, status, want):
    assert redeems_reset_credit(method, path, status) is want


@pytest.mark.parametrize("base,want", [
    ("https://chatgpt.com/backend-api/codex", "https://chatgpt.com/backend-api/wham/usage"),
    ("https://chatgpt.com/backend-api/", "https://chatgpt.com/backend-api/wham/usage"),
    ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/api/codex/usage"),
])
def test_usage_url(base, want):
    assert usage_url(base) == want


def usage(used, allowed=None, reached=None):
    limit = {"primary_window": {"used_percent": used, "reset_at": NOW + 60, "limit_window_seconds": 18000}}
    if allowed is not None:
        limit["allowed"] = allowed
    if reached is not None:
        limit["limit_reached"] = reached
    return {"plan_type": "plus", "rate_limit": limit}


@pytest.mark.parametrize("doc,full_at,want", [
    (usage(10.0, True, False), 100.0, True),
    (usage(100.0), 100.0, False),
    (usage(10.0, allowed=False), 100.0, False),
    (usage(10.0, reached=True), 100.0, False),
    (usage(85.0), 80.0, False),          # the credential's own max_usage_percent
    ({"plan_type": "plus"}, 100.0, None),
    ({"rate_limit": {}}, 100.0, None),
    ("not a dict", 100.0, None),
])
def test_usage_has_headroom(doc, full_at, want):
    assert usage_has_headroom(doc, full_at) is want


def test_the_real_usage_answer_shape():
    doc = json.loads((WIRE / "http" / "wham_usage_response.json").read_text())
    assert usage_has_headroom(doc) is True
    assert [(w.name, w.used_percent) for w in usage_windows(doc)] == [("primary", 27.0), ("secondary", 41.0)]


def test_recheck_pace_on_a_clock():
    clock = Clock()
    health = Health(clock)
    health.cool("long", 3 * 86400, "usage_limit")
    health.cool("window", 7200, "usage_window_full")
    health.cool("soon", 200, "usage_limit")         # ends before the next check anyway
    health.cool("busy", 3600, "overloaded")         # not a usage limit
    recheck = UsageRecheck(every=300.0)
    keys = ["long", "window", "soon", "busy", "ready"]
    assert recheck.due(health, keys) == ["long", "window"]
    for key in ("long", "window"):
        recheck.checked(key, clock.now)
    clock.now += 299
    assert recheck.due(health, keys) == []          # at most once per `every`
    clock.now += 1
    assert recheck.due(health, keys) == ["long", "window"]
    assert UsageRecheck(every=0).due(health, keys) == []


def test_ending_a_cooldown_remembers_how():
    clock = Clock()
    health = Health(clock)
    health.cool("a", 3600, "usage_limit")
    health.cool("b", 60, "overloaded")
    health.take_out("c", "HTTP 401 from upstream")
    ends = CooldownEnds()
    assert ends.end(health, "b", REDEEMED, usage_only=True) is None  # a reset credit does not end an overload
    assert health.state("b").status == "cooling"
    ended = ends.end(health, "a", REDEEMED, usage_only=True)
    assert (ended.how, ended.was, ended.at) == (REDEEMED, "usage_limit", NOW)
    assert health.ready("a")
    assert ends.end(health, "c", BY_HAND).was == "HTTP 401 from upstream" and health.ready("c")
    assert ends.end(health, "ready-one", BY_HAND) is None
    assert set(ends.last) == {"a", "c"}
