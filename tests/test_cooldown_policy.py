"""Overload cooldowns that do not cascade (core/cooldown_policy.py and its use in pool_feedback), on a
clock: streaks, the reset on success, the share of the pool held out."""

import pytest
from conftest import Clock

from codex_failover.config import ConfigError, Policy, parse_pool
from codex_failover.core.affinity import Affinity
from codex_failover.core.cooldown_policy import OverloadPolicy, OverloadStreaks, over_cap, parse_overload
from codex_failover.core.health import Health
from codex_failover.core.pool_feedback import PoolFeedback
from codex_failover.core.usage import UsageBook

DEFAULT = OverloadPolicy()


@pytest.mark.parametrize("gaps,want", [
    ([0], [15]),                                   # the first overload: a short rest
    ([0, 20, 40, 80], [15, 30, 60, 120]),          # a streak: doubling
    ([0] + [1] * 8, [15, 30, 60, 120, 240, 480, 900, 900, 900]),  # up to max (15 min)
    ([0, 601], [15, 15]),                          # outside streak_window: a new streak
    ([0, 600], [15, 30]),                          # at its edge: the same streak
])
def test_streaks(gaps, want):
    streaks, now, got = OverloadStreaks(), 0.0, []
    for gap in gaps:
        now += gap
        got.append(streaks.overloaded("a", now, DEFAULT))
    assert got == want


def test_a_success_ends_the_streak():
    streaks = OverloadStreaks()
    assert [streaks.overloaded("a", t, DEFAULT) for t in (0, 10, 20)] == [15, 30, 60]
    streaks.succeeded("a")
    assert streaks.overloaded("a", 30, DEFAULT) == 15


@pytest.mark.parametrize("share,size,cap", [(0.25, 4, 1), (0.25, 8, 2), (0.25, 2, 1), (0.5, 4, 2), (0.25, 1, 1),
                                            (1.0, 4, 4)])
def test_the_cap_is_a_share_of_the_pool_and_at_least_one(share, size, cap):
    assert OverloadPolicy(max_held_out=share).cap(size) == cap


def test_over_cap_brings_back_the_least_recently_failed_first():
    streaks = OverloadStreaks()
    for key, at in (("a", 10), ("b", 30), ("c", 20)):
        streaks.overloaded(key, at, DEFAULT)
    assert over_cap(["a", "b", "c"], streaks, 4, DEFAULT) == ["a", "c"]          # cap 1: b stays out
    assert over_cap(["a", "b", "c"], streaks, 8, DEFAULT) == ["a"]               # cap 2
    assert over_cap(["a", "b"], streaks, 4, OverloadPolicy(max_held_out=1.0)) == []  # the old behaviour


def world(size=4, **policy):
    clock = Clock()
    health = Health(clock)
    return clock, health, PoolFeedback(health, Affinity(clock=clock), UsageBook(), pool_size=size), Policy(**policy)


def test_feedback_rests_an_overloaded_account_for_its_streak_and_a_success_resets_it():
    clock, health, feedback, policy = world()
    feedback.rejected("a", "a", "overloaded", 200, {}, None, policy)
    assert health.recovers_in("a") == 15
    clock.now += 16
    feedback.rejected("a", "a", "slow_down", 200, {}, None, policy)
    assert health.recovers_in("a") == 30
    feedback.succeeded("a", None)
    assert health.ready("a")
    feedback.rejected("a", "a", "capacity", 200, {}, None, policy)
    assert health.recovers_in("a") == 15


def test_upstreams_own_time_wins_over_the_streak():
    _, health, feedback, policy = world()
    feedback.rejected("a", "a", "overloaded", 503, {}, "7", policy)
    assert health.recovers_in("a") == 7


def test_at_most_a_share_of_the_pool_rests_for_overload():
    clock, health, feedback, policy = world(size=4)
    for key in ("a", "b", "c"):
        feedback.rejected(key, key, "overloaded", 200, {}, None, policy)
        clock.now += 1
    # a quarter of four: one rests (c, the last to fail); a and b are back in rotation, streaks kept
    assert [health.state(k).status for k in "abc"] == ["ready", "ready", "cooling"]
    feedback.rejected("a", "a", "overloaded", 200, {}, None, policy)
    assert health.recovers_in("a") == 30 and health.ready("c")


def test_usage_limits_keep_following_resets_at_and_do_not_count_against_the_share():
    clock, health, feedback, policy = world(size=4)
    feedback.rejected("u", "u", "usage_limit", 429, {"resets_in_seconds": 7200}, None, policy)
    feedback.rejected("v", "v", "usage_limit", 429, {"resets_in_seconds": 3600}, None, policy)
    feedback.rejected("a", "a", "overloaded", 200, {}, None, policy)
    assert (health.recovers_in("u"), health.recovers_in("v"), health.recovers_in("a")) == (7200, 3600, 15)


@pytest.mark.parametrize("doc,want", [
    (None, DEFAULT),
    ({"first": "2m", "max": "15m", "factor": 2, "streak_window": "10m", "max_held_out": "25%"},
     OverloadPolicy(120, 2.0, 900, 600, 0.25)),
    ({"max_held_out": 0.5}, OverloadPolicy(max_held_out=0.5)),
    ({"first": "60s", "factor": 1, "max": "60s", "max_held_out": "100%"}, OverloadPolicy(60, 1.0, 60, 600, 1.0)),
])
def test_parse_overload(doc, want):
    assert parse_overload(doc, "overload") == want


@pytest.mark.parametrize("doc,needle", [
    ({"firts": "1s"}, "unknown field(s) firts"),
    ({"first": "soon"}, "overload.first"),
    ({"first": 0}, "overload.first: must be > 0"),
    ({"factor": 0.5}, "overload.factor"),
    ({"max_held_out": "0%"}, "overload.max_held_out"),
    ({"max_held_out": "150%"}, "overload.max_held_out"),
    ({"first": "10m", "max": "1m"}, "overload.max: must be at least first"),
    ("fast", "overload: expected a mapping"),
])
def test_a_bad_overload_section_names_the_field(doc, needle, tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_pool({"overload": doc}, "pool.yaml", {}, tmp_path)
    assert needle in str(info.value)


def test_an_older_pool_files_overload_cooldown_is_the_first_rest(tmp_path):
    pool = parse_pool({"policy": {"overload_cooldown": "1s"}}, "pool.yaml", {}, tmp_path)
    assert (pool.policy.overload.first, pool.policy.overload.max) == (1.0, 900.0)
    pool = parse_pool({"policy": {"overload_cooldown": "1h"}, "overload": {"first": "5s"}}, "pool.yaml", {}, tmp_path)
    assert pool.policy.overload.first == 5.0
    assert parse_pool({"policy": {"overload_cooldown": "20m"}}, "p", {}, tmp_path).policy.overload.max == 1200.0


def test_another_clients_own_key_never_counts_against_this_pools_share():
    clock = Clock()
    health = Health(clock)
    feedback = PoolFeedback(health, Affinity(clock=clock), UsageBook(), pool_size=2, pool_keys=frozenset({"spare"}))
    policy = Policy()
    for key in ("client:one", "client:two", "client:three"):
        feedback.rejected(key, key, "overloaded", 200, {}, None, policy)
        clock.now += 1
    assert all(health.state(k).status == "cooling" for k in ("client:one", "client:two", "client:three"))
    feedback.rejected("spare", "spare", "overloaded", 200, {}, None, policy)
    # Other clients' own keys are not this pool's: the spare's rest brings none of them back early.
    assert health.state("spare").status == "cooling"
    assert all(health.state(k).status == "cooling" for k in ("client:one", "client:two", "client:three"))
