"""End to end: two proxies share pool state through a real redis-server (issue 15): an overload or
a full usage window seen by one is honoured by the other, and Redis going away loses no request."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import time

import pytest
from harness import ProxyProcess, RedisProcess, pool_yaml, post_responses, wait_until

NO_REDIS = shutil.which("redis-server") is None
if NO_REDIS and os.environ.get("CI"):
    pytest.fail("redis-server is not installed: scripts/setup-system (which .ci/run calls) installs it",
                pytrace=False)
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(NO_REDIS, reason="redis-server is not installed (scripts/setup-system installs it)")]


def shared_proxy(tmp_path, fake, name, redis_url, creds, **policy):
    text, env = pool_yaml(fake.base, creds, **policy)
    text += f"state:\n  store: {redis_url}\n  namespace: team-a\n"
    return ProxyProcess(tmp_path / name, text, env)


def status(proxy) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "http://codex-failover.status/")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc



def served(fake) -> list[str]:
    return [r["credential"] for r in fake.model_requests()]


@pytest.fixture
def redis_server():
    server = RedisProcess()
    yield server
    server.stop()


def test_an_overload_seen_by_one_proxy_cools_the_credential_for_the_other(fake, tmp_path, redis_server, capsys):
    creds = [("spare", "sk-test-spare-good")]
    a = shared_proxy(tmp_path, fake, "a", redis_server.url, creds)
    b = shared_proxy(tmp_path, fake, "b", redis_server.url, creds)
    try:
        url = f"{fake.base}/v1/responses"
        assert post_responses(a.port, url, "sk-test-client-overload").status == 200
        seen_at = time.monotonic()
        wait_until(lambda: any(c["state"] == "cooling" for c in status(b)["clients"]), timeout=5,
                   what="proxy B to see the client's cooldown")
        took = time.monotonic() - seen_at
        with capsys.disabled():
            print(f"\n[shared-state] B saw A's cooldown {took * 1000:.0f} ms after A's answer "
                  f"(flush every 0.2 s, refresh every 0.5 s)")
        assert time.monotonic() - seen_at < 1.5
        assert post_responses(b.port, url, "sk-test-client-overload").status == 200
        assert served(fake) == ["sk-test-client-overload", "sk-test-spare-good", "sk-test-spare-good"]
    finally:
        a.stop()
        b.stop()


def test_a_full_usage_window_seen_by_one_proxy_is_honoured_by_the_other(fake, tmp_path, redis_server):
    creds = [("full", "sk-test-full-window-full"), ("other", "sk-test-other-good")]
    a = shared_proxy(tmp_path, fake, "a", redis_server.url, creds, use_client_credential=False)
    b = shared_proxy(tmp_path, fake, "b", redis_server.url, creds, use_client_credential=False)
    try:
        url = f"{fake.base}/v1/responses"
        assert post_responses(a.port, url, "sk-test-client-good").status == 200
        wait_until(lambda: next(c for c in status(b)["credentials"] if c["name"] == "full")["state"] == "cooling",
                 what="proxy B to see the full window")
        assert post_responses(b.port, url, "sk-test-client-good").status == 200
        assert served(fake) == ["sk-test-full-window-full", "sk-test-other-good"]
    finally:
        a.stop()
        b.stop()


def test_redis_going_away_loses_no_request_and_sharing_resumes_when_it_is_back(fake, tmp_path):
    redis = RedisProcess()
    creds = [("spare", "sk-test-spare-good")]
    a = shared_proxy(tmp_path, fake, "a", redis.url, creds)
    b = shared_proxy(tmp_path, fake, "b", redis.url, creds)
    try:
        url = f"{fake.base}/v1/responses"
        assert post_responses(a.port, url, "sk-test-client-good").status == 200
        redis.stop()
        for proxy in (a, b, a, b):  # every request is served, none waits on Redis
            started = time.monotonic()
            assert post_responses(proxy.port, url, "sk-test-client-good", timeout=10).status == 200
            assert time.monotonic() - started < 2.0
        for proxy in (a, b):
            wait_until(lambda p=proxy: "pool state store unavailable" in p.log(), what="the one warning")
            assert proxy.log().count("pool state store unavailable") == 1
        redis = RedisProcess(port=redis.port)  # back, empty
        wait_until(lambda: "store is back" in a.log() and "store is back" in b.log(), timeout=40,
                 what="both proxies to reconnect")
        assert post_responses(a.port, url, "sk-test-client-overload").status == 200
        wait_until(lambda: any(c["state"] == "cooling" for c in status(b)["clients"]), what="B to see the cooldown")
        assert _b_skips_client(b, fake, url)
    finally:
        a.stop()
        b.stop()
        redis.stop()


def _b_skips_client(b, fake, url) -> bool:
    before = len(fake.model_requests())
    assert post_responses(b.port, url, "sk-test-client-overload").status == 200
    return [r["credential"] for r in fake.model_requests()[before:]] == ["sk-test-spare-good"]


def test_a_compaction_made_through_one_proxy_is_placed_by_the_other(fake, tmp_path, redis_server):
    """Which credential made a compaction is shared state too: a session that moved between proxies
    (two machines, one Redis) still goes to the account that holds it."""
    creds = [("work", "sk-test-work-good")]
    a = shared_proxy(tmp_path, fake, "a", redis_server.url, creds)
    b = shared_proxy(tmp_path, fake, "b", redis_server.url, creds)
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}
    body = {"model": "gpt-fake", "stream": True, "store": False, "input": [user, {"type": "compaction_trigger"}]}
    try:
        url = f"{fake.base}/v1/responses"
        compacted = post_responses(a.port, url, "sk-test-own-overload-503", body)  # own 503: work compacts
        assert compacted.status == 200, compacted.body[:300]
        item = next(json.loads(line[6:])["item"] for line in compacted.body.decode().splitlines()
                    if line.startswith("data: ") and '"compaction"' in line and "output_item.done" in line)
        wait_until(lambda: status(b)["artifacts_known"] >= 2, timeout=5,
                   what="proxy B to learn who made the compaction")  # its id and its content's digest
        after = post_responses(b.port, url, "sk-test-own-good", {**body, "input": [item, user]})
        assert after.status == 200, after.body[:300]
    finally:
        a.stop()
        b.stop()
    assert served(fake)[-1] == "sk-test-work-good", served(fake)
