"""Unit tests: pool state to rows and back (state_keeper.py) and the SQLite store. Injected clocks."""

from __future__ import annotations

import json
import sys

from codex_failover.config import parse_pool
from codex_failover.core.affinity import Affinity
from codex_failover.core.health import Health
from codex_failover.core.routes import RouteHealth
from codex_failover.core.usage import UsageBook, Window
from codex_failover.state_keeper import StateKeeper, credential_id
from codex_failover.state_store import Row, SqliteStore, default_sqlite_path

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


# -- change tracking: a pass costs the changes, not the entries held (issue 27) --------------

import asyncio  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from codex_failover import state_keeper  # noqa: E402
from codex_failover.core.affinity import seen_step  # noqa: E402
from codex_failover.state_keeper import FLUSH, close_keeper, open_keeper  # noqa: E402
from codex_failover.state_rows import Kind  # noqa: E402
from codex_failover.state_store import describe_fault  # noqa: E402


def held_world(sessions=0):
    """A keeper whose pool holds `sessions` sessions, a cooldown, a usage window and a backoff,
    all written already (start)."""
    wall, mono = Clock(1_800_000_000.0), Clock(5_000.0)
    pool, keeper = world(wall, mono)
    keeper.affinity.max_sessions = 10_000
    keeper.health.cool("spare", 600, "overloaded")
    keeper.usage.record("spare", [Window("primary", 42.0, None)])
    keeper.routes.failed(pool.routes["corp"][0], "refused")
    for i in range(sessions):
        keeper.affinity.set(f"thread-{i}", "spare")
    keeper.start([])  # nothing to restore; what is held counts as written
    keeper.changes()
    return pool, keeper, wall, mono


def later(wall, mono, seconds):
    wall.t += seconds
    mono.t += seconds


@pytest.mark.parametrize("what, step, written, deleted", [
    ("nothing", lambda p, k, w, m: None, [], []),
    ("time passes within a session's step", lambda p, k, w, m: later(w, m, 30), [], []),
    ("the cooldown ends (an expiry)", lambda p, k, w, m: (later(w, m, 601), k.health.state("spare")), [], []),
    ("a session expires", lambda p, k, w, m: (later(w, m, 3601), k.affinity.get("thread-1")), [], []),
    ("the same usage again", lambda p, k, w, m: k.usage.record("spare", [Window("primary", 42.0, None)]), [], []),
    ("a shorter cooldown (never shortens)", lambda p, k, w, m: k.health.cool("spare", 5, "overloaded"), [], []),
    ("the same turn again soon", lambda p, k, w, m: (later(w, m, 30), k.affinity.set("thread-1", "spare")), [], []),
    ("a route that never failed succeeds", lambda p, k, w, m: k.routes.succeeded(_other_ep()), [], []),
    ("a new session", lambda p, k, w, m: k.affinity.set("thread-new", "spare"), ["session"], []),
    ("a session's turn a step later", lambda p, k, w, m: (later(w, m, 61), k.affinity.set("thread-1", "spare")),
     ["session"], []),
    ("a session moves home", lambda p, k, w, m: k.affinity.set("thread-1", "client:abc"), ["session"], []),
    ("a longer cooldown", lambda p, k, w, m: k.health.cool("spare", 900, "overloaded"), ["cooling"], []),
    ("taken out", lambda p, k, w, m: k.health.take_out("spare", "HTTP 401"), ["out"], []),
    ("restored", lambda p, k, w, m: k.health.restore("spare"), [], ["cooling"]),
    ("new usage", lambda p, k, w, m: k.usage.record("spare", [Window("primary", 43.0, None)]), ["usage"], []),
    ("the route fails again", lambda p, k, w, m: k.routes.failed(p.routes["corp"][0], "refused"), ["route"], []),
    ("the route is back", lambda p, k, w, m: k.routes.succeeded(p.routes["corp"][0]), [], ["route"]),
])
def test_a_pass_writes_what_changed_and_nothing_else(what, step, written, deleted):
    pool, keeper, wall, mono = held_world(sessions=3)
    step(pool, keeper, wall, mono)
    upserts, deletes = keeper.changes()
    assert [r.kind for r in upserts] == written, what
    assert [kind for kind, _ in deletes] == deleted, what
    assert keeper.changes() == ([], []), "written once"


def _other_ep():
    from codex_failover.core.routes import parse_endpoint

    return parse_endpoint("other", 0, "http://proxy2.test:3128")


def test_a_session_seen_is_stored_as_a_wall_time_written_when_it_moves_a_step():
    pool, keeper, wall, mono = held_world()
    keeper.affinity.set("t", "spare")
    (row,), _ = keeper.changes()
    assert row.value == {"credential": credential_id(pool.credentials[0].auth), "seen": wall.t}
    assert row.expires == wall.t + 3600
    assert seen_step(3600) == 60 and seen_step(300) == 30  # a tenth of a short session_idle
    for _ in range(5):  # a busy session: a turn every 20 s, written once a step
        later(wall, mono, 20)
        keeper.affinity.set("t", "spare")
    upserts, _ = keeper.changes()
    assert [r.value["seen"] for r in upserts] == [wall.t - 40]  # the turn at +60 s


def test_ten_thousand_sessions_and_one_changed_is_one_row_converted_and_written():
    pool, keeper, wall, mono = held_world(sessions=10_000)
    converted = []
    at = next(i for i, kind in enumerate(keeper.kinds) if kind.source is keeper.affinity)
    session_kind = keeper.kinds[at]
    rows = session_kind.rows
    keeper.kinds[at] = Kind(session_kind.source, lambda s: converted.append(s) or rows(s), session_kind.ids)
    later(wall, mono, 61)
    keeper.affinity.set("thread-5000", "spare")
    t0 = time.thread_time()  # this thread's CPU: what the pass costs the event loop, whatever else runs
    upserts, deletes = keeper.changes()
    took = time.thread_time() - t0
    assert [r.id for r in upserts] == ["thread-5000"] and deletes == []
    assert converted == ["thread-5000"]
    assert took < 0.010, took  # a pass costs the change: microseconds (the full snapshot took ~65 ms)
    keeper.affinity.set("thread-new", "spare")  # over max_sessions: the least recently used goes
    upserts, deletes = keeper.changes()
    assert [r.id for r in upserts] == ["thread-new"] and deletes == [("session", "thread-0")]


def test_rows_read_back_from_a_shared_store_are_not_written_back():
    pool, keeper, wall, mono = held_world()
    other = [Row("cooling", credential_id(pool.credentials[0].auth), {"until": wall.t + 900, "reason": "x"},
                 wall.t + 900)]
    keeper.health.take_out("client:abc", "HTTP 401")  # a local change, not yet written
    keeper.applied_quietly(other, sessions=False)
    assert keeper.health.recovers_in("spare") == 900
    upserts, _ = keeper.changes()
    assert [r.kind for r in upserts] == ["out"]  # the local change only


class CountingStore:
    shared = False

    def __init__(self, fail=0):
        self.writes, self.fail = [], fail

    def write(self, upserts, deletes):
        if self.fail:
            self.fail -= 1
            raise OSError("down")
        self.writes.append((list(upserts), list(deletes)))

    def load(self, now):
        return []

    def close(self):
        pass


def run_for(keeper, seconds, during=None):
    async def go():
        task = asyncio.get_running_loop().create_task(keeper.run())
        if during is not None:
            await during()
        await asyncio.sleep(seconds)
        task.cancel()
    asyncio.run(go())


def test_an_idle_proxy_runs_no_pass_and_a_change_is_written_once_flush_seconds_later():
    pool, keeper, wall, mono = held_world(sessions=100)
    keeper.store = CountingStore()
    seen = {}

    async def idle_then_change():
        await asyncio.sleep(0.6)
        seen["idle passes"], seen["idle writes"] = keeper.passes, list(keeper.store.writes)
        keeper.health.take_out("spare", "HTTP 401")  # one request's changes
        keeper.affinity.set("thread-new", "spare")
    run_for(keeper, FLUSH + 0.4, idle_then_change)
    assert seen == {"idle passes": 0, "idle writes": []}  # no timer: nothing woke it
    assert keeper.passes == 1
    assert [sorted(r.kind for r in upserts) for upserts, _ in keeper.store.writes] == [["out", "session"]]


def test_a_shared_store_is_read_every_refresh_even_when_nothing_changes(monkeypatch):
    monkeypatch.setattr(state_keeper, "REFRESH", 0.1)
    _, keeper, _, _ = held_world()
    store = CountingStore()
    store.shared, loads = True, []
    store.load = lambda now: loads.append(now) or []
    keeper.store, keeper._mono = store, time.monotonic
    run_for(keeper, 1.0)
    assert 6 <= len(loads) <= 12, len(loads)  # every REFRESH, never a spin
    assert store.writes == []


def test_a_failed_write_is_retried_and_then_everything_is_written(monkeypatch, caplog):
    monkeypatch.setattr(state_keeper, "RETRY_FIRST", 0.05)
    pool, keeper, wall, mono = held_world(sessions=3)
    keeper.store = CountingStore(fail=2)
    keeper._mono = time.monotonic  # the retry timer runs on the real clock here

    async def change():
        keeper.health.take_out("spare", "HTTP 401")
    with caplog.at_level(logging.WARNING, "codex_failover"):
        run_for(keeper, FLUSH + 0.6, change)
    (upserts, deletes), = keeper.store.writes
    assert sorted(r.kind for r in upserts) == ["cooling", "out", "route", "session", "session", "session", "usage"]
    assert caplog.text.count("pool state store unavailable") == 1 and "store is back" in caplog.text


# -- the SQLite file's faults (issue 26, item 7) ---------------------------------------------

def sqlite_keeper(tmp_path, sessions=2):
    pool, keeper, wall, mono = held_world(sessions)
    store = SqliteStore(tmp_path / "s.sqlite", "default")
    keeper.store, keeper.where = store, str(store.path)
    keeper.store.write(list(keeper.snapshot().values()), [])
    return pool, keeper, store


def ids_in(path):
    import sqlite3

    db = sqlite3.connect(path)
    try:
        return sorted(r[0] for r in db.execute("SELECT kind FROM state"))
    finally:
        db.close()


EVERYTHING = ["cooling", "route", "session", "session", "usage"]


@pytest.mark.parametrize("fault", ["deleted", "corrupted", "replaced"])
def test_a_file_deleted_or_corrupted_while_running_is_said_once_and_written_afresh(tmp_path, caplog, fault):
    pool, keeper, store = sqlite_keeper(tmp_path)
    path = store.path
    if fault == "deleted":
        path.unlink()
    elif fault == "corrupted":
        path.write_bytes(b"\0garbage" * 1024)
    else:
        path.unlink()
        other = SqliteStore(path, "default")  # another file at the path, with nothing of ours
        other.close()

    async def change():
        keeper.health.take_out("spare", "HTTP 401")
    with caplog.at_level(logging.WARNING, "codex_failover"):
        run_for(keeper, 2 * FLUSH + 0.5, change)
    store.close()
    assert ids_in(path) == sorted(EVERYTHING + ["out"]), fault
    assert caplog.text.count(f"pool state file {path} was {fault} while running; writing it afresh") == 1
    assert (path.with_name("s.sqlite.corrupt").exists()) == (fault == "corrupted")


def test_a_failed_open_at_start_is_retried_with_backoff_and_then_restores(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(state_keeper, "RETRY_FIRST", 0.05)
    good = tmp_path / "state" / "s.sqlite"
    seed = SqliteStore(good, "default")
    seed.write([Row("out", "client:abc", {"reason": "HTTP 401", "fingerprint": "abc"}, None)], [])
    seed.close()
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the folder should be")
    pool = parse_pool({**POOL, "state": {"store": f"sqlite://{blocker}/s.sqlite"}}, "pool.yaml",
                      {"K": "sk-test-secret-1"}, None)
    health, usage, routes, affinity = Health(), UsageBook(), RouteHealth(), Affinity()
    opens = []

    async def go():
        keeper = open_keeper(pool, None, health, usage, routes, affinity)
        assert keeper.store is None
        real = keeper.opener

        def opener():
            opens.append(time.monotonic())
            if len(opens) < 3:
                return real()  # still the blocked path: fails
            return SqliteStore(good, "default")
        keeper.opener = opener
        health.cool("spare", 60, "overloaded")  # learned while the store was away
        await asyncio.sleep(1.0)
        close_keeper(keeper)

    with caplog.at_level(logging.INFO, "codex_failover"):
        asyncio.run(go())
    assert len(opens) == 3
    assert opens[2] - opens[1] > opens[1] - opens[0] > 0.04  # backoff: 0.1 s, then 0.2 s
    assert caplog.text.count("pool state store unavailable") == 1
    assert f"{blocker}/s.sqlite" in caplog.text and "1 entry restored" in caplog.text
    assert health.state("client:abc").status == "out"  # restored once it opened
    assert ids_in(good) == ["cooling", "out"]  # and what it learned meanwhile written


def test_a_full_disk_is_named_as_such(tmp_path, caplog):
    pool, keeper, store = sqlite_keeper(tmp_path, sessions=0)
    store._db.execute("PRAGMA max_page_count = 2")  # the file cannot grow: SQLite's SQLITE_FULL

    async def change():
        for i in range(300):
            keeper.affinity.set(f"thread-{i}-" + "x" * 200, "spare")
    with caplog.at_level(logging.WARNING, "codex_failover"):
        run_for(keeper, FLUSH + 0.3, change)
    assert "pool state store unavailable" in caplog.text
    assert f"{store.path}: the disk is full (database or disk is full)" in caplog.text
    assert describe_fault(OSError(28, "No space left on device")).startswith("the disk is full")


def immutable(path, on: bool) -> bool:
    """chattr +i: the file cannot be opened for writing, even by root (who ignores modes)."""
    try:
        return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_a_read_only_file_is_restored_read_only_with_one_warning(tmp_path, caplog):
    path = tmp_path / "s.sqlite"
    seed = SqliteStore(path, "default")
    seed.write([Row("out", "client:abc", {"reason": "HTTP 401", "fingerprint": "abc"}, None)], [])
    seed.close()
    if not immutable(path, True):
        pytest.skip("chattr +i is not available here (needs root and a file system that has it)")
    try:
        pool = parse_pool({"state": {"store": f"sqlite://{path}"}}, "pool.yaml", {}, None)
        health = Health()

        async def go():
            keeper = open_keeper(pool, None, health, UsageBook(), RouteHealth(), Affinity())
            health.take_out("client:def", "HTTP 403")
            await asyncio.sleep(FLUSH + 0.2)
            close_keeper(keeper)
        with caplog.at_level(logging.INFO, "codex_failover"):
            asyncio.run(go())
    finally:
        immutable(path, False)
    assert health.state("client:abc").status == "out"  # restored
    assert caplog.text.count(f"pool state file {path} is read-only: 1 entry restored from it; changes are kept "
                             "in memory only") == 1, caplog.text
    assert "unavailable" not in caplog.text and "could not" not in caplog.text, caplog.text
    assert ids_in(path) == ["out"]  # untouched


def test_a_store_that_cannot_be_read_at_start_is_read_once_it_answers(monkeypatch, caplog):
    """Redis not up yet when the proxy starts: its rows are restored once it answers."""
    monkeypatch.setattr(state_keeper, "RETRY_FIRST", 0.05)
    row = Row("out", "client:abc", {"reason": "HTTP 401", "fingerprint": "abc"}, None)

    class LateStore(CountingStore):
        loads = 0

        def load(self, now):
            LateStore.loads += 1
            if LateStore.loads == 1:
                raise ConnectionError("Connection refused")
            return [row]
    monkeypatch.setattr(state_keeper, "open_store", lambda spec, namespace: LateStore())
    pool = parse_pool({**POOL, "state": {"store": "redis://127.0.0.1:1/0"}}, "pool.yaml", {"K": "sk-test-secret-1"},
                      None)
    health = Health()

    async def go():
        keeper = open_keeper(pool, None, health, UsageBook(), RouteHealth(), Affinity())
        await asyncio.sleep(0.5)
        close_keeper(keeper)
    with caplog.at_level(logging.INFO, "codex_failover"):
        asyncio.run(go())
    assert health.state("client:abc").status == "out"
    assert caplog.text.count("pool state store unavailable: redis://127.0.0.1:1/0: ConnectionError") == 1
    assert "1 entry restored" in caplog.text


def test_a_whole_rewrite_of_ten_thousand_sessions_is_several_short_passes():
    """After a store failure or a lost file every row is written again: in passes of at most
    PASS_KEYS keys, so no pass holds the event loop for the whole state."""
    pool, keeper, wall, mono = held_world(sessions=10_000)
    keeper.store = CountingStore()
    took = []
    convert = keeper._convert

    def timed(taken):
        t0 = time.thread_time()  # this thread's CPU (a parallel test run shares the cores)
        try:
            return convert(taken)
        finally:
            took.append(time.thread_time() - t0)
    keeper._convert = timed

    async def lose_the_store():
        keeper._whole = True
        keeper.changed.set()
    run_for(keeper, 8 * FLUSH + 0.5, lose_the_store)
    sizes = [len(upserts) for upserts, _ in keeper.store.writes]
    assert len(sizes) >= 5 and max(sizes) <= state_keeper.PASS_KEYS, sizes
    written = {r.id for upserts, _ in keeper.store.writes for r in upserts if r.kind == "session"}
    assert len(written) == 10_000
    assert max(took) < 0.05, took  # ~5 ms each; the whole state at once took 16-29 ms


def test_provenance_is_one_row_per_artifact_restored_after_a_restart():
    pool, keeper, wall, mono = held_world()
    keeper.changes()
    keeper.provenance.record(["item:cmp_1", "enc:abc"], "spare")
    upserts, _ = keeper.changes()
    assert sorted((r.kind, r.id, r.value["credential"]) for r in upserts) == [
        ("artifact", "enc:abc", credential_id(pool.credentials[0].auth)),
        ("artifact", "item:cmp_1", credential_id(pool.credentials[0].auth))]
    assert keeper.changes() == ([], [])  # asked for again at once: nothing to write
    keeper.provenance.owner(["item:cmp_1"])
    assert keeper.changes() == ([], [])
    fresh = StateKeeper(None, Health(clock=wall), UsageBook(), RouteHealth(clock=mono), Affinity(clock=mono), wall, mono)
    fresh.bind(pool)
    assert fresh.start(upserts) == 2
    assert fresh.provenance.owner(["item:cmp_1"]) == "spare"


READ_ELSEWHERE = """import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
print(sorted(i for (i,) in db.execute("SELECT id FROM state")))
db.close()
"""


def test_a_reader_in_another_process_never_loses_what_is_written_after_it(tmp_path):
    """Another process reading the file (the other proxy sharing it, `sqlite3` in a terminal, a test)
    and closing it must not take the WAL from under the running store. The store's own check (is the
    file still the one opened?) once opened and closed the file, and a close drops every POSIX lock the
    process holds on it, SQLite's too: the reader's close then found no other connection, checkpointed
    and deleted the WAL, and every later write went to the deleted one: seen by no other process while
    it ran (a second proxy on the file, `sqlite3`), lost if it was killed (a clean exit checkpoints it)."""
    path = tmp_path / "s.sqlite"
    store = SqliteStore(path, "default")
    read = [sys.executable, "-c", READ_ELSEWHERE, str(path)]
    try:
        for n in range(3):
            assert store.write([Row("out", f"client:{n}", {"reason": "x", "fingerprint": str(n)}, None)], []) is None
            seen = subprocess.run(read, capture_output=True, text=True, timeout=30, check=True).stdout
            assert seen.strip() == repr([f"client:{i}" for i in range(n + 1)]), f"after write {n}: {seen}"
    finally:
        store.close()
