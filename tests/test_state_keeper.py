"""Unit tests: pool state to rows and back (state_keeper.py) and the SQLite store. Injected clocks."""

from __future__ import annotations

import json

from codex_failover.core.affinity import Affinity
from codex_failover.config import parse_pool
from codex_failover.core.health import Health
from codex_failover.core.routes import RouteHealth
from codex_failover.state_keeper import StateKeeper, credential_id
from codex_failover.state_store import Row, SqliteStore, default_sqlite_path
from codex_failover.core.usage import UsageBook, Window

POOL = {"credentials": [{"name": "spare", "api_key_env": "K", "route": "corp"}],
        "routes": {"corp": ["http://u:p@proxy.test:3128"]}}


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def world(wall, mono, env=None):
    pool = parse_pool(POOL, "pool.yaml", env or {"K": "sk-test-secret-1"}, None)
    health, usage = Health(wall), UsageBook()
    routes, affinity = RouteHealth(30, 300, mono), Affinity(3600, 100, mono)
    keeper = StateKeeper(None, health, usage, routes, affinity, wall, mono)
    keeper.bind(pool)
    return pool, keeper


def test_state_round_trips_across_a_restart_with_a_new_monotonic_clock():
    wall, mono = Clock(1_800_000_000.0), Clock(500.0)
    pool, keeper = world(wall, mono)
    ep = pool.routes["corp"][0]
    keeper.health.cool("spare", 120, "overloaded")
    keeper.health.take_out("client:abc", "HTTP 401")
    keeper.usage.record("spare", [Window("primary", 42.0, wall.t + 600)])
    keeper.routes.failed(ep, "refused")
    keeper.affinity.set("thread-1", "spare")
    rows = list(keeper.snapshot().values())
    text = json.dumps([r.value for r in rows]) + " ".join(r.id for r in rows)
    assert "sk-test" not in text
    assert "u:p" not in text
    assert ":p@" not in text

    wall2, mono2 = Clock(wall.t + 10), Clock(7.0)  # ten seconds later, after a reboot
    _, fresh = world(wall2, mono2)
    assert fresh.start(rows) == 5
    assert fresh.health.state("spare").status == "cooling"
    assert round(fresh.health.recovers_in("spare")) == 110
    assert fresh.health.state("client:abc").status == "out"
    assert fresh.usage.windows("spare") == [Window("primary", 42.0, wall.t + 600)]
    assert "backing off 20s more" in fresh.routes.describe(pool.routes["corp"][0])
    assert fresh.affinity.get("thread-1") == "spare"


def test_a_new_key_under_the_same_name_is_a_new_credential():
    wall, mono = Clock(1_800_000_000.0), Clock(5.0)
    _, keeper = world(wall, mono)
    keeper.health.take_out("spare", "HTTP 401")
    rows = list(keeper.snapshot().values())
    _, renewed = world(wall, mono, {"K": "sk-test-secret-2"})
    assert renewed.start(rows) == 0
    assert renewed.health.state("spare").status == "ready"


def test_changes_are_diffs():
    wall, mono = Clock(1_800_000_000.0), Clock(5.0)
    _, keeper = world(wall, mono)
    keeper.start([])
    assert keeper.changes() == ([], [])
    keeper.health.cool("spare", 60, "overloaded")
    upserts, deletes = keeper.changes()
    assert [r.kind for r in upserts] == ["cooling"]
    assert deletes == []
    keeper.health.restore("spare")
    assert keeper.changes() == ([], [("cooling", credential_id(keeper_auth(keeper)))])


def keeper_auth(keeper):
    return parse_pool(POOL, "pool.yaml", {"K": "sk-test-secret-1"}, None).credentials[0].auth


def test_sqlite_store_keeps_rows_per_namespace_and_drops_expired(tmp_path):
    path = tmp_path / "s.sqlite"
    a, b = SqliteStore(path, "team-a"), SqliteStore(path, "team-b")
    a.write([Row("cooling", "cred:1", {"until": 200.0, "reason": "x"}, 200.0),
             Row("out", "cred:2", {"reason": "y"}, None)], [])
    b.write([Row("cooling", "cred:1", {"until": 900.0, "reason": "z"}, 900.0)], [])
    assert {r.id for r in a.load(now=100.0)} == {"cred:1", "cred:2"}
    assert [r.id for r in a.load(now=300.0)] == ["cred:2"]  # expired: gone
    assert [r.value["reason"] for r in b.load(now=300.0)] == ["z"]
    a.write([], [("out", "cred:2")])
    assert a.load(now=300.0) == []
    a.close()
    b.close()


def test_default_path_follows_xdg_state_home():
    assert str(default_sqlite_path({"XDG_STATE_HOME": "/x/state"})) == "/x/state/codex-failover/state.sqlite"
    assert str(default_sqlite_path({"HOME": "/home/me"})) == "/home/me/.local/state/codex-failover/state.sqlite"


def jwt(claims: dict) -> str:
    import base64

    def part(doc):
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'none'})}.{part(claims)}.sig"


def test_members_of_one_chatgpt_workspace_get_distinct_ids():
    from codex_failover.core.auth import CHATGPT, AuthMaterial

    def member(user):
        token = jwt({"sub": user, "https://api.openai.com/auth": {"chatgpt_user_id": user}})
        return AuthMaterial(CHATGPT, token, account_id="acct-team")
    assert credential_id(member("user-alice")) != credential_id(member("user-bob"))
    refreshed = AuthMaterial(CHATGPT, jwt({"sub": "user-alice", "exp": 2, "https://api.openai.com/auth":
                                           {"chatgpt_user_id": "user-alice"}}), account_id="acct-team")
    assert credential_id(refreshed) == credential_id(member("user-alice"))  # a token refresh keeps the id


def test_a_row_of_another_shape_is_skipped_alone():
    wall, mono = Clock(1_800_000_000.0), Clock(5.0)
    pool, keeper = world(wall, mono)
    good = Row("cooling", credential_id(pool.credentials[0].auth), {"until": wall.t + 60, "reason": "overloaded"},
               wall.t + 60)
    odd = [Row("cooling", "client:abc", {"until_wall": 5}, None), Row("route", "ep:x", "not a dict", None),
           Row("session", "s", {"credential": 7, "seen": "yesterday"}, None), Row("usage", "client:abc", {}, None)]
    assert keeper.start(odd + [good]) == 1
    assert keeper.health.state("spare").status == "cooling"


def test_endpoint_ids_leave_the_password_out():
    from codex_failover.core.routes import parse_endpoint
    from codex_failover.state_keeper import endpoint_id

    a = parse_endpoint("corp", 0, "http://u:one@proxy.test:3128")
    b = parse_endpoint("corp", 0, "http://u:two@proxy.test:3128")
    assert endpoint_id(a) == endpoint_id(b)


# -- the flush loop: FLUSH while there is something to write, less often when idle, a poke wakes it --

import asyncio  # noqa: E402

import pytest  # noqa: E402

from codex_failover import state_keeper  # noqa: E402
from codex_failover.state_keeper import FLUSH, IDLE_FLUSH, next_interval  # noqa: E402


@pytest.mark.parametrize("current, wrote, shared, expected", [
    (FLUSH, True, False, FLUSH),  # changes: keep the pace
    (FLUSH, False, False, 2 * FLUSH),  # nothing: look half as often
    (IDLE_FLUSH, False, False, IDLE_FLUSH),  # bounded
    (IDLE_FLUSH, True, False, FLUSH),  # a change: back to the pace at once
    (FLUSH, False, True, FLUSH),  # a shared store: the others read it every REFRESH (docs/state.md)
])
def test_next_interval(current, wrote, shared, expected):
    assert next_interval(current, wrote, shared) == expected


class CountingStore:
    shared = False

    def __init__(self):
        self.writes = []

    def write(self, upserts, deletes):
        self.writes.append((upserts, deletes))


def test_an_idle_local_store_is_looked_at_less_and_less_often(monkeypatch):
    monkeypatch.setattr(state_keeper, "FLUSH", 0.01)
    monkeypatch.setattr(state_keeper, "IDLE_FLUSH", 0.32)
    wall, mono = Clock(1_800_000_000.0), Clock(5.0)
    _, keeper = world(wall, mono)
    keeper.store = CountingStore()
    keeper.start([])
    looks = []
    snapshot = keeper.snapshot
    monkeypatch.setattr(keeper, "snapshot", lambda: looks.append(1) or snapshot())

    async def go():
        task = asyncio.get_running_loop().create_task(keeper.run())
        await asyncio.sleep(1.0)
        task.cancel()

    asyncio.run(go())
    assert 2 <= len(looks) <= 15, len(looks)  # at a steady 10 ms: ~100
    assert keeper.interval == 0.32


def test_a_poke_ends_a_long_wait_and_the_change_is_written():
    _, keeper = world(Clock(1_800_000_000.0), Clock(5.0))
    keeper.store = CountingStore()
    keeper.start([])
    keeper.interval = 30.0  # idle for long

    async def go():
        task = asyncio.get_running_loop().create_task(keeper.run())
        await asyncio.sleep(0.05)
        keeper.health.cool("spare", 60, "overloaded")  # a request's rejection
        keeper.poke()  # the request ended
        for _ in range(100):  # bounded: ~FLUSH after the poke, never the 30 s
            if keeper.store.writes:
                break
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(go())
    assert [[r.kind for r in upserts] for upserts, _ in keeper.store.writes] == [["cooling"]]
    assert keeper.interval == FLUSH
