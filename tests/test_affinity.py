"""Session affinity and the selection order it feeds."""

from dataclasses import replace

from conftest import Clock

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.affinity import Affinity, session_of
from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.health import Health
from codex_failover.core.planner import make_plan


def test_session_key_from_headers_then_prompt_cache_key():
    assert session_of({"session-id": "a"}, {"prompt_cache_key": "b"}) == "a"
    assert session_of({"session_id": "old"}, None) == "old"
    assert session_of({}, {"prompt_cache_key": "b"}) == "b"
    assert session_of({}, {"prompt_cache_key": ""}) is None
    assert session_of({}, None) is None


def test_stickiness_expires_when_idle():
    clock = Clock()
    aff = Affinity(idle=60, clock=clock)
    aff.set("s1", "spare")
    clock.now += 59
    assert aff.get("s1") == "spare"
    aff.set("s2", "other")
    clock.now += 2
    assert aff.get("s1") is None
    assert aff.get("s2") == "other"
    assert aff.get(None) is None


def test_memory_is_bounded_least_recently_used_first():
    aff = Affinity(max_sessions=100, clock=Clock())
    for i in range(10_000):
        aff.set(f"s{i}", "k")
    assert len(aff) == 100
    assert aff.get("s9999") == "k"
    assert aff.get("s0") is None


def creds(*specs):
    return tuple(Credential(name, AuthMaterial(APIKEY, f"tok-{name}"), "https://x/v1", "$X", priority)
                 for name, priority in specs)


def names(plan):
    return [c.name for c in plan.candidates]


def test_sticky_credential_goes_first():
    pool = PoolConfig(creds(("a", 0), ("b", 0), ("c", 0)), Policy())
    health = Health(Clock())
    assert names(make_plan(AuthMaterial(APIKEY, "me"), pool, health, sticky="c")) == ["c", "client", "a", "b"]
    # A cooling sticky credential is skipped like any other.
    health.cool("c", 30, "overloaded")
    assert names(make_plan(AuthMaterial(APIKEY, "me"), pool, health, sticky="c")) == ["client", "a", "b"]


def test_priority_then_fill_first_or_round_robin():
    pool = PoolConfig(creds(("low", 5), ("a", 0), ("b", 0), ("c", 0)), Policy(use_client_credential=False, max_attempts=8))
    health = Health(Clock())
    me = AuthMaterial(APIKEY, "me")
    assert names(make_plan(me, pool, health, rotation=1)) == ["a", "b", "c", "low"]
    rr = replace(pool, policy=replace(pool.policy, selection="round-robin"))
    assert [names(make_plan(me, rr, health, rotation=r)) for r in range(3)] == [
        ["a", "b", "c", "low"], ["b", "c", "a", "low"], ["c", "a", "b", "low"]]


def test_expired_chatgpt_token_is_skipped_never_sent():
    clock = Clock()
    expired = Credential("old", AuthMaterial(CHATGPT, "a.b.c", "acct", expires_at=clock.now - 1), "https://x", "f")
    fresh = Credential("new", AuthMaterial(CHATGPT, "d.e.f", "acct2", expires_at=clock.now + 3600), "https://x", "f")
    plan = make_plan(AuthMaterial(CHATGPT, "g.h.i", "mine"), PoolConfig((expired, fresh), Policy()), Health(clock))
    assert names(plan) == ["client", "new"]
    assert [(c.name, why) for c, why in plan.skipped] == [("old", "expired")]
