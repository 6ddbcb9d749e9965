"""End to end: pooled ChatGPT logins refresh themselves (issue 46 item 1), against the fake token
endpoint (tests/support/fake_oauth.py, served by the fake upstream at /oauth/token and named by
`failover_refresh_url`).

A login past Codex's 8-day interval is refreshed once at start; the next attempt carries the new
access token (the old one is revoked at the fake: a 401 otherwise); auth.json holds the rotated
tokens in Codex's format with its mode kept; the real Codex CLI on that CODEX_HOME then refreshes
with the refresh token the proxy wrote. Racing refreshes (a Codex-like writer in the middle of the
proxy's, two proxies over one Redis) end with both working; a permanent failure takes the
credential out with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from fake_oauth import access_token, auth_json
from harness import FakeUpstreamProcess, ProxyProcess, RedisProcess, post_responses, proxy_status, wait_until

pytestmark = pytest.mark.e2e

ACCOUNT = "acct-work-good"
DAY = 86400


def url(fake):
    return f"{fake.base}/v1/responses"


def seed(fake, folder: Path, account: str = ACCOUNT, age: float = 9 * DAY, mode: int = 0o640,
         revoked: bool = False) -> Path:
    """A Codex login of `account` in `folder` last refreshed `age` seconds ago, known to the fake
    (`revoked`: its access token is refused with 401)."""
    folder.mkdir(parents=True, exist_ok=True)
    access, refresh = access_token(account, 0), f"rt-{account}-0"
    path = folder / "auth.json"
    path.write_text(json.dumps(auth_json(account, access, refresh, time.time() - age), indent=2))
    os.chmod(path, mode)
    fake.control("/_fake/oauth/account", {"account": account, "refresh_token": refresh, "access_token": access,
                                          "revoked": revoked})
    return path


def pool(fake, path: Path, name: str = "work", state: str | None = None) -> str:
    text = (f"credentials:\n  - name: {name}\n    auth_file: {path}\n    base_url: {fake.base}/v1\n"
            "policy: {cooldown_wait: 0}\n")
    return text + (f"state: {{store: '{state}'}}\n" if state else "")


def ask(proxy, fake):
    """A ChatGPT-login client whose own account is overloaded: the pooled login serves."""
    return post_responses(proxy.port, url(fake), access_token("acct-client-overload", 0),
                          headers={"chatgpt-account-id": "acct-client-overload"})


def refresh_opts(fake) -> list[str]:
    return ["--set", f"failover_refresh_url={fake.base}/oauth/token"]


def oauth(fake) -> list[dict]:
    return [r for r in fake.requests() if r.get("event") == "oauth"]


def sha(token: str) -> str:
    import hashlib

    return hashlib.sha256(f"Bearer {token}".encode()).hexdigest()[:12]


def assert_no_secret(log: str, *docs: dict) -> None:
    assert "SECRET-ANSWER-TEXT" not in log
    for doc in docs:
        for key in ("access_token", "refresh_token", "id_token"):
            assert doc["tokens"][key] not in log


def test_a_login_past_its_interval_is_refreshed_once_and_the_next_attempt_carries_the_new_token(fake, tmp_path):
    path = seed(fake, tmp_path / "work")
    before = json.loads(path.read_text())
    proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
    try:
        wait_until(lambda: "tokens refreshed" in proxy.log(), 10, "the refresh at start")
        (call,) = oauth(fake)
        assert call["status"] == 200 and call["client_id_ok"] and call["grant_type_ok"]
        assert call["content_type"] == "application/json"
        after = json.loads(path.read_text())
        assert path.read_text() == json.dumps(after, indent=2)  # Codex's format
        assert stat.S_IMODE(path.stat().st_mode) == 0o640  # its mode kept
        assert after["tokens"]["account_id"] == ACCOUNT and after["auth_mode"] == "chatgpt"
        assert after["tokens"]["refresh_token"] == f"rt-{ACCOUNT}-1" != before["tokens"]["refresh_token"]
        assert after["tokens"]["access_token"] != before["tokens"]["access_token"]
        assert after["last_refresh"] != before["last_refresh"]
        assert (path.parent / "auth.json.lock").exists()
        assert sorted(p.name for p in path.parent.iterdir()) == ["auth.json", "auth.json.lock"]  # no temporary left
        reply = ask(proxy, fake)
        assert reply.status == 200, reply.body[:300]
        assert f"Hello from {ACCOUNT}" in reply.body.decode()
        spare = [r for r in fake.model_requests() if r["credential"] == ACCOUNT]
        assert [r["auth_sha"] for r in spare] == [sha(after["tokens"]["access_token"])]
        time.sleep(1.1)
        ask(proxy, fake)
        assert len(oauth(fake)) == 1  # once: fresh now
        assert "credential work: tokens refreshed (last refreshed over 8 days ago)" in proxy.log()
        assert "auth file changed on disk" not in proxy.log()  # its own write is not news
        assert_no_secret(proxy.log(), before, after)
    finally:
        proxy.stop()


def test_a_401_forces_one_refresh_and_the_credential_comes_back(fake, tmp_path):
    path = seed(fake, tmp_path / "work", age=DAY, revoked=True)  # fresh by its dates, refused upstream
    proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
    try:
        reply = ask(proxy, fake)
        assert reply.status != 200  # the spare's 401 is never shown, nothing else can serve
        wait_until(lambda: "tokens refreshed (upstream answered 401); in rotation again" in proxy.log(), 10,
                   "the forced refresh")
        assert len(oauth(fake)) == 1
        reply = ask(proxy, fake)
        assert f"Hello from {ACCOUNT}" in reply.body.decode(), reply.body[:300]
        new = json.loads(path.read_text())["tokens"]["access_token"]
        assert [r["auth_sha"] for r in fake.model_requests() if r["credential"] == ACCOUNT][-1] == sha(new)
    finally:
        proxy.stop()


def test_a_fresh_token_refused_again_stays_out_with_one_line_and_no_refresh_loop(fake, tmp_path):
    """An account that refuses every token (even a freshly refreshed one): one forced refresh, then
    out of rotation with one line; requests go on to the other credential, none to the endpoint."""
    bad = seed(fake, tmp_path / "bad", account="acct-unauthorized", age=DAY)
    good = seed(fake, tmp_path / "good", age=DAY)
    text = (f"credentials:\n  - name: bad\n    auth_file: {bad}\n    base_url: {fake.base}/v1\n"
            f"  - name: good\n    auth_file: {good}\n    base_url: {fake.base}/v1\npolicy: {{cooldown_wait: 0}}\n")
    proxy = ProxyProcess(tmp_path / "p", text, extra=refresh_opts(fake))
    try:
        assert ask(proxy, fake).status == 200  # bad: 401, moved to good; bad's forced refresh follows
        wait_until(lambda: "credential bad: tokens refreshed (upstream answered 401); in rotation again" in proxy.log(),
                   10, "the forced refresh")
        assert ask(proxy, fake).status == 200  # bad's fresh token refused too: moved again
        wait_until(lambda: "freshly refreshed token too" in proxy.log(), 10, "bad out for good")
        for _ in range(3):
            assert ask(proxy, fake).status == 200
            time.sleep(1.1)  # (the refresher looks at most once a second)
        assert len(oauth(fake)) == 1  # one refresh for the login, not one per request
        assert len([r for r in fake.model_requests() if r["credential"] == "acct-unauthorized"]) == 2
        lines = [x for x in proxy.log().splitlines() if "credential bad: upstream answered 401 to its freshly" in x]
        assert len(lines) == 1 and "out of rotation until you log in again: CODEX_HOME=" in lines[0]
        assert next(c for c in proxy_status(proxy.port)["credentials"] if c["name"] == "bad")["state"] == "out"
    finally:
        proxy.stop()


@pytest.mark.parametrize("meanwhile", ["logout", "login"])
def test_a_refresh_in_flight_never_undoes_a_codex_logout_or_a_new_login(fake, tmp_path, meanwhile):
    """The token endpoint answers late; meanwhile the user runs `codex logout` (the file removed) or
    `codex login` of another account (Codex takes no lock): the refreshed tokens are dropped."""
    path = seed(fake, tmp_path / "work")
    fake.control("/_fake/oauth/next", {"delay": 2})
    proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
    try:
        wait_until(lambda: any(r.get("event") == "oauth_waiting" for r in fake.requests()), 10,
                   "the refresh at start waiting for its answer")
        other = auth_json("acct-someone-else", access_token("acct-someone-else", 0), "rt-someone-else", time.time())
        if meanwhile == "logout":
            path.unlink()
        else:
            path.write_text(json.dumps(other, indent=2))
        wait_until(lambda: "changed while its token refresh was under way" in proxy.log(), 10, "the refresh's end")
        if meanwhile == "logout":
            assert not path.exists()  # not re-created
        else:
            assert json.loads(path.read_text()) == other  # the new login kept
        assert len(oauth(fake)) == 1 and "tokens refreshed" not in proxy.log()
        lines = [x for x in proxy.log().splitlines() if "changed while its token refresh" in x]
        assert len(lines) == 1 and "the refreshed tokens are dropped and the file is read again" in lines[0]
        if meanwhile == "login":
            reply = ask(proxy, fake)  # the auth watch read the new login: it serves
            assert "Hello from acct-someone-else" in reply.body.decode(), reply.body[:300]
        else:
            ask(proxy, fake)
            wait_until(lambda: "credential work: cannot read" in proxy.log(), 5, "the auth watch's line")
    finally:
        proxy.stop()


def test_a_permanent_refresh_failure_takes_the_credential_out_with_one_line(fake, tmp_path):
    path = seed(fake, tmp_path / "work")
    fake.control("/_fake/oauth/next", {"scenario": "refresh_token_expired"})
    proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
    try:
        wait_until(lambda: "token refresh refused" in proxy.log(), 10, "the refusal")
        lines = [x for x in proxy.log().splitlines() if "credential work:" in x and "refresh" in x
                 and "ChatGPT access token" not in x]
        assert len(lines) == 1, lines
        assert "refresh_token_expired" in lines[0] and f"CODEX_HOME={path.parent} codex login" in lines[0]
        assert proxy_status(proxy.port)["credentials"][0]["state"] == "out"
        reply = ask(proxy, fake)
        assert reply.status != 200
        assert ACCOUNT not in [r["credential"] for r in fake.model_requests()]
        time.sleep(1.1)
        ask(proxy, fake)
        assert len(oauth(fake)) == 1  # never retried
        assert_no_secret(proxy.log(), json.loads(path.read_text()))
    finally:
        proxy.stop()


def test_refresh_token_reused_is_answered_by_reading_the_file_again(fake, tmp_path):
    """Someone else (a Codex on that CODEX_HOME) refreshes between the proxy's read and its POST:
    the endpoint says refresh_token_reused, the proxy reads the file again and uses what it finds."""
    path = seed(fake, tmp_path / "work")
    fake.control("/_fake/oauth/next", {"scenario": "race", "path": str(path)})
    proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
    try:
        wait_until(lambda: "refresh_token_reused; its auth.json read again" in proxy.log(), 10, "the re-read")
        theirs = json.loads(path.read_text())
        reply = ask(proxy, fake)
        assert f"Hello from {ACCOUNT}" in reply.body.decode(), reply.body[:300]
        spare = [r for r in fake.model_requests() if r["credential"] == ACCOUNT]
        assert [r["auth_sha"] for r in spare] == [sha(theirs["tokens"]["access_token"])]
        assert len(oauth(fake)) == 1 and "token refresh refused" not in proxy.log()
        assert_no_secret(proxy.log(), theirs)
    finally:
        proxy.stop()


def test_two_proxies_over_one_redis_refresh_an_account_once_and_both_serve_with_it(fake, tmp_path):
    redis = RedisProcess()
    path = seed(fake, tmp_path / "work")
    fake.control("/_fake/oauth/next", {"delay": 4})  # the first proxy's refresh is still in flight when the second starts
    proxies = []
    try:
        for n in range(2):
            proxies.append(ProxyProcess(tmp_path / f"p{n}", pool(fake, path, state=redis.url), extra=refresh_opts(fake)))
        wait_until(lambda: "another proxy is refreshing this account" in proxies[1].log(), 10, "the second's claim refused")
        wait_until(lambda: json.loads(path.read_text())["tokens"]["refresh_token"] != f"rt-{ACCOUNT}-0", 10,
                   "the refresh")
        time.sleep(1.1)  # the auth files are looked at once a second
        new = json.loads(path.read_text())["tokens"]["access_token"]
        for proxy in proxies:
            reply = ask(proxy, fake)
            assert f"Hello from {ACCOUNT}" in reply.body.decode(), reply.body[:300] + proxy.log().encode()
        assert [r["status"] for r in oauth(fake)] == [200]  # one refresh, no reused token
        spare = [r for r in fake.model_requests() if r["credential"] == ACCOUNT]
        assert [r["auth_sha"] for r in spare] == [sha(new)] * 2
    finally:
        for proxy in proxies:
            proxy.stop()
        redis.stop()


# -- the real Codex CLI on the refreshed account's CODEX_HOME --------------------------------------

from test_codex_cli import CODEX_TIMEOUT, _events, _run_bounded, codex_bin  # noqa: E402,F401


def test_real_codex_refreshes_with_the_refresh_token_the_proxy_wrote(tmp_path, codex_bin):  # noqa: F811
    """After the proxy's refresh, Codex on that CODEX_HOME finds its login due again (its access
    token made to have ended, the proxy's refresh token kept): it refreshes with the refresh token
    the proxy wrote, which the fake accepts once, and its turn completes: no refresh_token_reused."""
    fake = FakeUpstreamProcess(tmp_path / "fake", "--pace", "0.002", "--deltas", "5")
    proxy = codex_proxy = None
    try:
        home = tmp_path / "work"
        path = seed(fake, home, mode=0o600)
        proxy = ProxyProcess(tmp_path / "p", pool(fake, path), extra=refresh_opts(fake))
        wait_until(lambda: "tokens refreshed" in proxy.log(), 10, "the proxy's refresh")
        proxy.stop()
        doc = json.loads(path.read_text())
        assert doc["tokens"]["refresh_token"] == f"rt-{ACCOUNT}-1"
        # Codex refreshes it again, with the refresh token the proxy wrote: its access token has ended.
        doc["tokens"]["access_token"] = access_token(ACCOUNT, 99, exp=time.time() - 60)
        path.write_text(json.dumps(doc, indent=2))
        to_fake = rf"|^https?://(?!127\.0\.0\.1[:/])[^/]+|{fake.base}"
        codex_proxy = ProxyProcess(tmp_path / "c", None, extra=["--set", "connection_strategy=lazy",
                                                                 "--set", f"map_remote={to_fake}",
                                                                 "--set", "failover_intercept=all"])
        proxy_url = f"http://127.0.0.1:{codex_proxy.port}"
        (tmp_path / "home").mkdir()
        (tmp_path / "cwd").mkdir()
        env = {"PATH": f"{Path(shutil.which('node')).parent}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
               "CODEX_HOME": str(home), "LANG": "C.UTF-8",
               "CODEX_CA_CERTIFICATE": str(codex_proxy.confdir / "mitmproxy-ca-cert.pem"),
               "CODEX_REFRESH_TOKEN_URL_OVERRIDE": f"{fake.base}/oauth/token",
               "HTTPS_PROXY": proxy_url, "https_proxy": proxy_url, "HTTP_PROXY": proxy_url, "http_proxy": proxy_url,
               "NO_PROXY": "", "no_proxy": ""}
        run = _run_bounded([str(codex_bin), "exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only",
                            "--cd", str(tmp_path / "cwd"), "say hi"], CODEX_TIMEOUT, env=env, cwd=tmp_path / "cwd")
        context = f"\n{run.stdout}\n{run.stderr[-3000:]}\n{fake.log_path.read_text()}"
        assert run.returncode == 0, context
        assert "refresh_token_reused" not in run.stdout + run.stderr, context
        assert any(f"Hello from {ACCOUNT}" in e.get("item", {}).get("text", "") for e in _events(run.stdout)), context
        calls = oauth(fake)
        assert [c["status"] for c in calls] == [200, 200], context  # the proxy's, then Codex's with its token
        assert json.loads(path.read_text())["tokens"]["refresh_token"] == f"rt-{ACCOUNT}-2"
    finally:
        for p in (proxy, codex_proxy):
            if p is not None:
                p.stop()
        fake.stop()


def test_a_redis_claim_is_held_by_one_proxy_and_released_by_it_only():
    from codex_failover.state_store import RedisStore

    redis = RedisProcess()
    try:
        store = RedisStore(redis.url, "cf46")
        assert store.claim("refresh:acct", "proxy-a", 5.0)
        assert not store.claim("refresh:acct", "proxy-b", 5.0)  # held
        store.release("refresh:acct", "proxy-b")  # not its claim: no effect
        assert not store.claim("refresh:acct", "proxy-b", 5.0)
        store.release("refresh:acct", "proxy-a")
        assert store.claim("refresh:acct", "proxy-b", 0.2)
        time.sleep(0.3)  # a claim lapses by itself (a proxy that died mid-refresh)
        assert store.claim("refresh:acct", "proxy-c", 5.0)
        assert store.load(time.time()) == []  # claims are not rows
        store.close()
    finally:
        redis.stop()
