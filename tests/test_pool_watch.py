"""The pool file is re-read when it changes on disk (pool_watch.py), like auth files: an edit is
picked up without a restart, and an edit that does not load keeps the pool in force with one line."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from harness import ProxyProcess, pool_yaml, post_responses

from codex_failover.pool_watch import PoolWatch


def test_each_new_state_of_the_file_is_one_change(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("credentials: []\n")
    watch = PoolWatch()
    watch.remember(str(path))
    assert watch.changed() is False
    path.write_text("credentials: [] # edited\n")
    assert watch.changed() is True
    assert watch.changed() is False  # reported once, whether or not it loads
    path.unlink()
    assert watch.changed() is True  # gone: loading it says so


def test_a_new_file_in_place_with_the_same_size_and_time_is_a_change():
    stats = iter([SimpleNamespace(st_mtime_ns=1, st_size=10, st_ino=1), SimpleNamespace(st_mtime_ns=1, st_size=10, st_ino=2)])
    watch = PoolWatch(stat=lambda path: next(stats))
    watch.remember("/x/pool.yaml")
    assert watch.changed() is True


def test_no_pool_file_never_changes():
    watch = PoolWatch(stat=lambda path: pytest.fail("nothing to stat"))
    watch.remember(None)
    assert watch.changed() is False


def served_by(fake, key: str) -> bool:
    return any(r["credential"] == key and r["scenario"] == "good" for r in fake.model_requests())


@pytest.mark.e2e
def test_a_pool_edit_is_picked_up_without_a_restart_and_a_broken_edit_keeps_the_pool(fake, tmp_path):
    text, env = pool_yaml(fake.base, [("first", "sk-test-first-good")])
    second, env2 = pool_yaml(fake.base, [("second", "sk-test-second-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, **env2})
    pool = tmp_path / "pool.yaml"
    url = f"{fake.base}/v1/responses"
    try:
        assert post_responses(proxy.port, url, "sk-test-client-overload").status == 200
        assert served_by(fake, "sk-test-first-good")

        pool.write_text(second)
        time.sleep(1.1)  # the addon looks at most once a second
        assert post_responses(proxy.port, url, "sk-test-client-overload").status == 200
        assert served_by(fake, "sk-test-second-good"), proxy.log()[-3000:]
        assert "pool file changed on disk" in proxy.log()

        pool.write_text(second + "policy: [not, a, mapping\n")  # a typo mid-edit
        time.sleep(1.1)
        for _ in range(3):
            assert post_responses(proxy.port, url, "sk-test-client-overload").status == 200
            time.sleep(0.4)
        broken = [line for line in proxy.log().splitlines() if "cannot be used" in line]
        assert len(broken) == 1, proxy.log()[-3000:]
        assert proxy.log().count("pool file changed on disk") == 1  # the good edit's line only
        assert str(pool) in broken[0]
        served = [r["credential"] for r in fake.model_requests() if r["scenario"] == "good"]
        assert served[-3:] == ["sk-test-second-good"] * 3  # the pool in force stayed
    finally:
        proxy.stop()
    assert "sk-test-" not in proxy.log()
