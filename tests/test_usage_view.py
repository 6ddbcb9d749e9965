"""What Codex is told about its limits when its own account is limited (core/usage_view.py)."""

import json

import pytest
from conftest import WIRE, Clock

from codex_failover.core.usage_view import UsageCache, is_usage_request, own_can_send, pooled_view

REAL = json.loads((WIRE / "http" / "wham_usage_response.json").read_text())


def limited():
    return {"plan_type": "plus", "rate_limit": {"allowed": False, "limit_reached": True,
                                                "primary_window": {"used_percent": 100.0, "reset_at": 1}}}


@pytest.mark.parametrize("method,path,want", [
    ("GET", "/backend-api/wham/usage", True),
    ("GET", "/api/codex/usage?x=1", True),
    ("POST", "/backend-api/wham/usage", False),
    ("GET", "/backend-api/wham/usage/extra", False),
    ("GET", "/backend-api/codex/responses", False),
])
def test_is_usage_request(method, path, want):
    assert is_usage_request(method, path) is want


@pytest.mark.parametrize("status,doc,ready,want", [
    (200, REAL, True, True),            # its own answer stands
    (200, limited(), True, False),      # it says the limit is reached
    (200, REAL, False, False),          # the pool has it cooling (a 429 it sent a turn)
    (401, {"error": {}}, True, False),  # no answer
    (200, {"plan_type": "plus"}, True, True),  # says nothing about limits: left alone
])
def test_own_can_send(status, doc, ready, want):
    assert own_can_send(status, doc, ready) is want


def test_the_pooled_answer_is_that_credentials_own_and_says_so():
    view = pooled_view(REAL, "work", 200)
    assert view["rate_limit"] == REAL["rate_limit"] and view["plan_type"] == REAL["plan_type"]
    assert view["codex_failover"]["served_by"] == "work" and view["codex_failover"]["own_account"] == "limited"
    first = view["additional_rate_limits"][0]
    assert first["limit_name"] == "pool: work" and first["rate_limit"] == REAL["rate_limit"]
    assert view["additional_rate_limits"][1:] == REAL["additional_rate_limits"]
    assert "codex_failover" not in REAL  # the cached answer is never changed


def test_cache_on_a_clock():
    clock = Clock()
    cache = UsageCache(ttl=30, clock=clock)
    cache.put("a", {"x": 1})
    clock.now += 30
    assert cache.get("a") == {"x": 1}
    clock.now += 0.1
    assert cache.get("a") is None and cache.get("b") is None
