"""End to end: pool state survives a restart (SQLite, the default store), and holds no secret
(issue 15). Each test runs one proxy, stops it, and starts another on the same state folder."""

from __future__ import annotations

import sqlite3
import time

import pytest
from harness import LocalProxies, ProxyProcess, dead_port, pool_yaml, post_responses, wait_until

pytestmark = pytest.mark.e2e

CLIENT = "sk-test-client-overload"
KEYS = {"spare": "sk-test-spare-good", "flaky": "sk-test-flaky-unauthorized"}


def restart(tmp_path, fake, creds, env_extra=None, routes=None, **policy):
    """A proxy on `tmp_path`'s state folder (the same across calls): returns a started ProxyProcess."""
    text, env = pool_yaml(fake.base, creds, routes, **policy)
    n = len(list(tmp_path.glob("run*")))
    return ProxyProcess(tmp_path / f"run{n}", text, {**env, "XDG_STATE_HOME": str(tmp_path / "state"),
                                                     **(env_extra or {})})


def restored(proxy) -> str:
    """The start-up line saying what was restored (logged once the proxy runs)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        line = next((x for x in proxy.log().splitlines() if "entries restored" in x or "entry restored" in x), None)
        if line:
            return line
        time.sleep(0.05)
    raise AssertionError("no state line in the log:\n" + proxy.log())


def served(fake) -> list[str]:
    return [r["credential"] for r in fake.model_requests()]


def state_rows(tmp_path) -> list[tuple]:
    db = sqlite3.connect(tmp_path / "state" / "codex-failover" / "state.sqlite")
    try:
        return db.execute("SELECT kind, id, value, expires FROM state").fetchall()
    finally:
        db.close()


def test_a_cooldown_and_the_sessions_home_survive_a_restart(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    proxy = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="120s")
    try:
        reply = post_responses(proxy.port, url, CLIENT, headers={"session-id": "thread-7"})
        assert reply.status == 200, reply.body[:300]
        assert served(fake) == [CLIENT, KEYS["spare"]]
    finally:
        proxy.stop()
    assert restored(proxy).endswith(": 0 entries restored")

    again = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="120s")
    try:
        # The client's cooldown and usage, the spare's usage, the session, the spare's response id.
        assert restored(again).endswith(": 5 entries restored"), again.log()
        reply = post_responses(again.port, url, CLIENT, headers={"session-id": "thread-7"})
        assert reply.status == 200
        assert served(fake)[2:] == [KEYS["spare"]], "the cooling client credential was dialled after the restart"
        status = again.log()
    finally:
        again.stop()
    data = (tmp_path / "state" / "codex-failover" / "state.sqlite").read_bytes()
    assert b"sk-test" not in data, "a secret in the state file"
    assert "attempt 1/1 credential=spare" in status or "credential=spare" in status


def test_expired_state_is_not_restored(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    proxy = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="1s", session_idle="1s")
    try:
        assert post_responses(proxy.port, url, CLIENT, headers={"session-id": "t"}).status == 200
    finally:
        proxy.stop()
    time.sleep(1.2)
    again = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="1s", session_idle="1s")
    try:
        assert post_responses(again.port, url, CLIENT).status == 200
    finally:
        again.stop()
    assert served(fake)[2] == CLIENT, "an expired cooldown was restored"


def test_out_of_rotation_survives_a_restart_until_the_key_changes(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    creds = [("flaky", KEYS["flaky"]), ("spare", KEYS["spare"])]
    proxy = restart(tmp_path, fake, creds, use_client_credential=False)
    try:
        assert post_responses(proxy.port, url, "sk-test-client-good").status == 200
        assert served(fake) == [KEYS["flaky"], KEYS["spare"]]
    finally:
        proxy.stop()
    again = restart(tmp_path, fake, creds, use_client_credential=False)
    try:
        assert post_responses(again.port, url, "sk-test-client-good").status == 200
        assert served(fake)[2:] == [KEYS["spare"]], "the credential taken out was dialled after the restart"
    finally:
        again.stop()
    # A new key under the same name is a new credential: in rotation.
    renewed = restart(tmp_path, fake, [("flaky", "sk-test-flaky-renewed-good"), ("spare", KEYS["spare"])],
                      use_client_credential=False)
    try:
        assert post_responses(renewed.port, url, "sk-test-client-good").status == 200
        assert served(fake)[3] == "sk-test-flaky-renewed-good"
    finally:
        renewed.stop()


def test_a_dead_route_endpoints_backoff_survives_a_restart(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    local = LocalProxies()
    try:
        alive = local.http_proxy("alive")
        dead = f"http://127.0.0.1:{dead_port()}"
        routes = {"corp": [dead, f"http://127.0.0.1:{alive}"]}
        creds = [("work", "sk-test-work-good", "corp")]
        proxy = restart(tmp_path, fake, creds, routes=routes, use_client_credential=False)
        try:
            assert post_responses(proxy.port, url, "sk-test-client-good").status == 200
            assert "failed before dispatch" in proxy.log()
        finally:
            proxy.stop()
        again = restart(tmp_path, fake, creds, routes=routes, use_client_credential=False)
        try:
            assert post_responses(again.port, url, "sk-test-client-good").status == 200
            assert "failed before dispatch" not in again.log(), "the dead endpoint was dialled again"
        finally:
            again.stop()
    finally:
        local.close()
    kinds = {row[0] for row in state_rows(tmp_path)}
    assert "route" in kinds
    assert not any(b"@" in str(row[2]).encode() for row in state_rows(tmp_path))


def test_memory_store_keeps_nothing(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    for _ in range(2):
        text, env = pool_yaml(fake.base, [("spare", KEYS["spare"])])
        text += "state:\n  store: memory\n"
        n = len(list(tmp_path.glob("run*")))
        proxy = ProxyProcess(tmp_path / f"run{n}", text, {**env, "XDG_STATE_HOME": str(tmp_path / "state")})
        try:
            assert post_responses(proxy.port, url, CLIENT).status == 200
        finally:
            proxy.stop()
    assert served(fake) == [CLIENT, KEYS["spare"], CLIENT, KEYS["spare"]]
    assert not (tmp_path / "state").exists()


def test_max_usage_percent_leaves_headroom_and_is_remembered(fake, tmp_path):
    """The fake reports 10% of the primary window used: a credential with max_usage_percent 5 is not
    chosen again until the window resets, also after a restart."""
    url = f"{fake.base}/v1/responses"
    text = (f"credentials:\n"
            f"  - {{name: a, api_key_env: KEY_A, base_url: {fake.base}/v1, max_usage_percent: 5}}\n"
            f"  - {{name: b, api_key_env: KEY_B, base_url: {fake.base}/v1}}\n"
            f"policy: {{use_client_credential: false}}\n")
    env = {"KEY_A": "sk-test-a-good", "KEY_B": "sk-test-b-good", "XDG_STATE_HOME": str(tmp_path / "state")}
    for run in range(2):
        proxy = ProxyProcess(tmp_path / f"run{run}", text, env)
        try:
            assert post_responses(proxy.port, url, "sk-test-client-good").status == 200
            if run == 0:
                assert "at or over its max_usage_percent (5%)" in proxy.log()
        finally:
            proxy.stop()
    assert served(fake) == ["sk-test-a-good", "sk-test-b-good"]


def test_two_proxies_on_one_machine_share_the_sqlite_file_safely(fake, tmp_path):
    """WAL mode: two proxies writing the same file at once lose nothing and raise nothing."""
    url = f"{fake.base}/v1/responses"
    text, env = pool_yaml(fake.base, [("spare", KEYS["spare"])])
    env = {**env, "XDG_STATE_HOME": str(tmp_path / "state")}
    a, b = ProxyProcess(tmp_path / "a", text, env), ProxyProcess(tmp_path / "b", text, env)
    try:
        for i in range(6):
            proxy = a if i % 2 else b
            assert post_responses(proxy.port, url, f"sk-test-client{i}-overload",
                                  headers={"session-id": f"s{i}"}).status == 200
    finally:
        a.stop()
        b.stop()
    for proxy in (a, b):
        assert "could not save" not in proxy.log(), proxy.log()
        assert "unavailable" not in proxy.log(), proxy.log()
    kinds = [row[0] for row in state_rows(tmp_path)]
    assert kinds.count("cooling") == 6, kinds
    assert kinds.count("session") == 6, kinds


@pytest.mark.parametrize("fault", ["deleted", "corrupted"])
def test_a_state_file_lost_while_running_is_said_once_and_written_afresh(fake, tmp_path, fault):
    """Issue 26: the file deleted (or overwritten) under the running proxy: its next write notices,
    says so once with the path, and writes the whole state to a new file; a restart restores it."""
    url = f"{fake.base}/v1/responses"
    path = tmp_path / "state" / "codex-failover" / "state.sqlite"
    proxy = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="120s")
    try:
        assert post_responses(proxy.port, url, CLIENT, headers={"session-id": "thread-1"}).status == 200
        try:
            wait_until(lambda: path.exists() and len(state_rows(tmp_path)) >= 3, what="the first rows written")
        except AssertionError as exc:  # (seen once in CI, not understood yet: what there was, for the next look)
            rows = state_rows(tmp_path) if path.exists() else "no file"
            raise AssertionError(f"{exc}; rows: {rows}; log: {proxy.log()[-3000:]}") from None
        if fault == "deleted":
            path.unlink()
        else:
            path.write_bytes(b"not a database " * 700)
        other = "sk-test-other-overload"
        assert post_responses(proxy.port, url, other, headers={"session-id": "thread-2"}).status == 200
        line = f"pool state file {path} was {fault} while running; writing it afresh"
        wait_until(lambda: line in proxy.log(), what="the one warning")
        try:  # the whole state in the new file: both overloads' cooldowns (at least; a retry may add its own)
            wait_until(lambda: [r[0] for r in state_rows(tmp_path)].count("cooling") >= 2, what="written afresh")
        except AssertionError as exc:  # (seen once in a fresh clone's run: what there was, for the next look)
            rows = state_rows(tmp_path) if path.exists() else "no file"
            raise AssertionError(f"{exc}; rows: {rows}; log: {proxy.log()[-3000:]}") from None
        time.sleep(0.5)
        assert proxy.log().count("was " + fault) == 1, proxy.log()
    finally:
        proxy.stop()
    kinds = sorted(r[0] for r in state_rows(tmp_path))
    assert kinds.count("cooling") == 2 and kinds.count("session") == 2, kinds  # both requests' state
    again = restart(tmp_path, fake, [("spare", KEYS["spare"])], overload_cooldown="120s")
    try:
        assert "2 entries restored" not in restored(again)  # more than the second request's alone
        assert post_responses(again.port, url, CLIENT).status == 200
        assert served(fake)[-1] == KEYS["spare"], "the first request's cooldown was lost with the file"
    finally:
        again.stop()
