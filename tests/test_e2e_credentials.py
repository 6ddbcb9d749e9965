"""End to end: a credential whose auth.json cannot be used never stops the proxy (issue 46 item 2).

A removed, emptied or logged-out auth.json (`codex logout`), at start or while running, is one line
naming the file and the fix; the proxy serves with the rest and takes the credential back once the
file can be used again.
"""

from __future__ import annotations

import json
import time

import pytest
from harness import ProxyProcess, post_responses, proxy_status, wait_until

pytestmark = pytest.mark.e2e

LOGGED_OUT = json.dumps({"OPENAI_API_KEY": None, "tokens": None, "last_refresh": None}, indent=2)


def url(fake):
    return f"{fake.base}/v1/responses"


def _key(name):
    return json.dumps({"OPENAI_API_KEY": f"sk-test-{name}-good"})


def _pool(fake, tmp_path, names):
    lines = ["credentials:"]
    for name in names:
        (tmp_path / name).mkdir(exist_ok=True)
        lines.append(f"  - {{name: {name}, auth_file: {tmp_path / name / 'auth.json'}, base_url: {fake.base}/v1}}")
    return "\n".join(lines) + "\npolicy: {cooldown_wait: 0, max_attempts: 4}\n"


def _served_by(reply):
    assert reply.status == 200, reply.body[:300]
    return reply.body.decode().split("Hello from ", 1)[1].split(".", 1)[0]


def test_unusable_auth_files_at_start_and_while_running(fake, tmp_path):
    out, gone, good = (tmp_path / n / "auth.json" for n in ("out", "gone", "good"))
    pool = _pool(fake, tmp_path, ["out", "gone", "good"])
    out.write_text(LOGGED_OUT)  # `codex logout`; gone/auth.json does not exist
    good.write_text(_key("good"))
    proxy = ProxyProcess(tmp_path / "p1", pool)
    try:
        wait_until(lambda: "local clients" in proxy.log(), 10, "the start-up lines")
        log = proxy.log()
        for name, path, problem in (("out", out, "logged out"), ("gone", gone, "No such file or directory")):
            (line,) = [x for x in log.splitlines() if f"credential {name}:" in x]
            assert str(path) in line and problem in line
            assert f"CODEX_HOME={path.parent} codex login" in line
        assert "gone (skipped" in log
        shown = {c["name"]: c for c in proxy_status(proxy.port)["credentials"]}
        assert shown["out"]["state"] == "skipped" and "codex login" in shown["out"]["reason"]
        assert _served_by(post_responses(proxy.port, url(fake), "sk-test-client-overload")) == "sk-test-good-good"

        good.write_text(LOGGED_OUT)  # while running: logged out
        out.write_text(_key("out"))  # and another logged in again
        time.sleep(1.1)  # auth files are looked at, at most once a second
        assert _served_by(post_responses(proxy.port, url(fake), "sk-test-client-overload")) == "sk-test-out-good"
        log = proxy.log()
        (line,) = [x for x in log.splitlines() if "credential good:" in x and "out of rotation" in x]
        assert str(good) in line and f"CODEX_HOME={good.parent} codex login" in line
        assert "credential out: its auth file can be used again; in rotation" in log
        assert [r["credential"] for r in fake.model_requests()][-1] == "sk-test-out-good"
        assert [r["credential"] for r in fake.model_requests()].count("sk-test-good-good") == 1  # never again

        good.unlink()  # while running: removed
        time.sleep(1.1)
        assert _served_by(post_responses(proxy.port, url(fake), "sk-test-client-overload")) == "sk-test-out-good"
    finally:
        proxy.stop()
    # A restart with one file removed and one logged out: it starts and serves.
    out.write_text(LOGGED_OUT)
    gone.write_text(_key("gone"))
    proxy = ProxyProcess(tmp_path / "p2", pool)
    try:
        assert proxy.proc.poll() is None
        assert _served_by(post_responses(proxy.port, url(fake), "sk-test-client-overload")) == "sk-test-gone-good"
    finally:
        proxy.stop()
