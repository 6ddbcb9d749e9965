"""End to end: cooldowns that end when the account is back. Two pooled ChatGPT accounts on the fake
upstream (pool only, fill-first: `a` first); `a` is cooled by a 429 usage_limit_reached (reset in an
hour), then brought back by a redeemed reset credit, by its usage endpoint, or by hand."""

from __future__ import annotations

import base64
import json
import time

import pytest
from harness import ProxyProcess, post_responses, proxy_status, request, wait_until

RESET = {"X-Codex-Failover": "1"}  # what the status page's reset needs (a page cannot send it without a preflight)

pytestmark = pytest.mark.e2e


def jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


def start(fake, tmp_path, **policy) -> tuple[ProxyProcess, dict[str, str]]:
    tokens = {}
    lines = ["credentials:"]
    for name in ("a", "b"):
        tokens[name] = jwt({"exp": time.time() + 3600, "sub": name})
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens": {"access_token": tokens[name], "account_id": f"acct-{name}"}}))
        lines += [f"  - name: {name}", f"    auth_file: {path}", f"    base_url: {fake.base}/backend-api/codex"]
    settings = {"use_client_credential": "false", "bootstrap_timeout": "5s", **policy}
    lines += ["policy:", *(f"  {k}: {v}" for k, v in settings.items())]
    return ProxyProcess(tmp_path, "\n".join(lines) + "\n"), tokens


def turn(proxy, fake) -> str:
    """One model request from a ChatGPT client; the account that served it."""
    reply = post_responses(proxy.port, f"{fake.base}/backend-api/codex/responses", jwt({"exp": time.time() + 60}),
                           headers={"chatgpt-account-id": "acct-client"})
    assert reply.status == 200, reply.body[:300]
    return fake.model_requests()[-1]["credential"]


def cool_a(proxy, fake) -> None:
    fake.overload_next("acct-a", 1, "usage-limit")
    assert turn(proxy, fake) == "acct-b"  # a answered 429 usage_limit_reached: the turn moved
    assert turn(proxy, fake) == "acct-b"  # and a is skipped while it cools
    assert {c["name"]: c["state"] for c in proxy_status(proxy.port)["credentials"]}["a"] == "cooling"


def status_of(proxy, name: str) -> dict:
    return next(c for c in proxy_status(proxy.port)["credentials"] if c["name"] == name)


def test_a_redeemed_reset_credit_ends_the_cooldown_at_once(fake, tmp_path):
    proxy, tokens = start(fake, tmp_path)
    try:
        cool_a(proxy, fake)
        consumed = request(proxy.port, "POST", f"{fake.base}/backend-api/wham/rate-limit-reset-credits/consume",
                           {"authorization": f"Bearer {tokens['a']}", "chatgpt-account-id": "acct-a",
                            "content-type": "application/json"}, b"{}")
        assert consumed.status == 200
        assert "credential a: cooldown ended (reset credit redeemed; was usage_limit)" in proxy.log()
        assert turn(proxy, fake) == "acct-a"
        assert status_of(proxy, "a")["cooldown_ended"]["how"] == "reset credit redeemed"
    finally:
        proxy.stop()


def test_the_usage_endpoint_reporting_headroom_ends_the_cooldown(fake, tmp_path):
    proxy, _ = start(fake, tmp_path, usage_recheck="1s")
    try:
        fake.control("/_fake/usage", {"credential": "acct-a", "used_percent": 100})  # still limited at first
        cool_a(proxy, fake)
        wait_until(lambda: any(r.get("scenario") == "usage" for r in fake.requests()), 10, "the first usage re-check")
        assert status_of(proxy, "a")["state"] == "cooling"
        fake.control("/_fake/usage", {"credential": "acct-a", "used_percent": 10})  # its window reset early
        wait_until(lambda: "credential a: cooldown ended (usage endpoint reports headroom" in proxy.log(), 10,
                   "the usage re-check")
        asked = [r for r in fake.requests() if r.get("scenario") == "usage"]
        assert asked and {r["credential"] for r in asked} == {"acct-a"}  # a's own token, and only a is asked
        assert asked[0]["path"] == "/backend-api/wham/usage"
        assert turn(proxy, fake) == "acct-a"
        assert status_of(proxy, "a")["cooldown_ended"]["how"] == "usage endpoint reports headroom"
    finally:
        proxy.stop()


def test_the_usage_endpoint_still_limited_keeps_the_cooldown(fake, tmp_path):
    proxy, _ = start(fake, tmp_path, usage_recheck="1s")
    try:
        fake.control("/_fake/usage", {"credential": "acct-a", "used_percent": 100})
        cool_a(proxy, fake)
        wait_until(lambda: sum(r.get("scenario") == "usage" for r in fake.requests()) >= 2, 10, "two usage re-checks")
        assert status_of(proxy, "a")["state"] == "cooling"
        assert "cooldown ended" not in proxy.log()
    finally:
        proxy.stop()


def test_a_cooldown_ended_by_hand_from_the_status_page(fake, tmp_path):
    proxy, _ = start(fake, tmp_path)
    try:
        cool_a(proxy, fake)
        answer = request(proxy.port, "POST", "http://codex-failover.status/reset/a", headers=RESET)
        assert answer.status == 200
        assert "cooldown ended (ended by hand; was usage_limit)" in json.loads(answer.body)["result"]
        assert "credential a: cooldown ended (ended by hand; was usage_limit)" in proxy.log()
        assert turn(proxy, fake) == "acct-a"
        unknown = request(proxy.port, "POST", "http://codex-failover.status/reset/nobody", headers=RESET)
        assert unknown.status == 404
        doc = json.loads(unknown.body)
        assert "no credential named 'nobody'" in doc["error"] and doc["names"][:3] == ["a", "b", "client"]
        assert request(proxy.port, "POST", "http://codex-failover.status/reset/", headers=RESET).status == 404  # naming nothing
        for refused in ({}, {**RESET, "Origin": "http://evil.example"}, {**RESET, "Sec-Fetch-Site": "cross-site"},
                        {"X-Codex-Failover": "yes"}):
            assert request(proxy.port, "POST", "http://codex-failover.status/reset/a", headers=refused).status == 403
        for allowed in ({**RESET, "Origin": "http://codex-failover.status", "Sec-Fetch-Site": "same-origin"},
                        {**RESET, "Sec-Fetch-Site": "none"}):
            assert request(proxy.port, "POST", "http://codex-failover.status/reset/a", headers=allowed).status == 200
    finally:
        proxy.stop()


# -- the client's own account comes back -----------------------------------------------------------

def start_own(fake, tmp_path, **policy) -> ProxyProcess:
    """A pool (a, b) behind the client's own ChatGPT account, which is tried first."""
    proxy, _ = start(fake, tmp_path, **policy)
    return proxy


def own_turn(proxy, fake) -> str:
    reply = post_responses(proxy.port, f"{fake.base}/backend-api/codex/responses", jwt({"exp": time.time() + 60}),
                           headers={"chatgpt-account-id": "acct-own"})
    assert reply.status == 200, reply.body[:300]
    return fake.model_requests()[-1]["credential"]


def limit_own(proxy, fake) -> None:
    fake.overload_next("acct-own", 1, "usage-limit")
    assert own_turn(proxy, fake) == "acct-a"  # the own account's 429 usage_limit_reached: moved
    assert own_turn(proxy, fake) == "acct-a"  # and it is skipped while it cools
    (client,) = proxy_status(proxy.port)["clients"]
    assert client["state"] == "cooling" and client["reason"] == "usage_limit"


def test_the_own_accounts_usage_limit_ends_when_its_usage_endpoint_reports_headroom(fake, tmp_path):
    proxy = start_own(fake, tmp_path, usage_recheck="1s", use_client_credential="true")
    try:
        fake.control("/_fake/usage", {"credential": "acct-own", "used_percent": 100})
        limit_own(proxy, fake)
        wait_until(lambda: any(r.get("scenario") == "usage" for r in fake.requests()), 10, "the first re-check")
        fake.control("/_fake/usage", {"credential": "acct-own", "used_percent": 10})  # credits bought
        wait_until(lambda: "credential client account …-own: cooldown ended (usage endpoint reports headroom"
                   in proxy.log(), 10, "the own account's re-check")
        asked = [r for r in fake.requests() if r.get("scenario") == "usage"]
        assert {r["credential"] for r in asked} == {"acct-own"}  # with the token of its last request
        assert own_turn(proxy, fake) == "acct-own"  # served again
    finally:
        proxy.stop()


@pytest.mark.parametrize("name", ["client", "-own"])
def test_the_own_accounts_usage_limit_ended_by_hand(fake, tmp_path, name):
    proxy = start_own(fake, tmp_path, use_client_credential="true")
    try:
        limit_own(proxy, fake)
        answer = request(proxy.port, "POST", f"http://codex-failover.status/reset/{name}", headers=RESET)
        assert answer.status == 200, answer.body
        assert "credential client account …-own: cooldown ended (ended by hand; was usage_limit)" in \
            json.loads(answer.body)["result"]
        assert own_turn(proxy, fake) == "acct-own"
        again = request(proxy.port, "POST", f"http://codex-failover.status/reset/{name}", headers=RESET)
        assert again.status == 200 and "nothing to end" in json.loads(again.body)["result"]
    finally:
        proxy.stop()


def test_the_status_page_refuses_a_reset_from_another_machine_and_answers_404_for_other_posts(fake, tmp_path):
    from codex_failover.mitm.account_back import AccountBack

    class Flow:  # what reset_from_status_page reads
        def __init__(self, peer, path):
            self.client_conn = type("C", (), {"peername": (peer, 1)})()
            self.request = type("R", (), {"path": path, "headers": {"x-codex-failover": "1"}})()

    back = AccountBack(type("Owner", (), {"pool": None})())
    assert back.reset_from_status_page(Flow("192.0.2.7", "/reset/a")).status_code == 403
    assert back.reset_from_status_page(Flow("127.0.0.1", "/other")).status_code == 404


# -- what Codex is told about its limits (GET …/wham/usage through the proxy) ---------------------

def set_usage(fake, account: str, used: float) -> None:
    fake.control("/_fake/usage", {"credential": account, "used_percent": used})


def ask_usage(proxy, fake, token: str, account: str):
    return request(proxy.port, "GET", f"{fake.base}/backend-api/wham/usage",
                   {"authorization": f"Bearer {token}", "chatgpt-account-id": account})


def test_a_limited_own_account_is_told_the_usage_of_the_pooled_account_its_next_turn_goes_to(fake, tmp_path):
    proxy, _ = start(fake, tmp_path)
    try:
        set_usage(fake, "acct-client", 100)
        set_usage(fake, "acct-a", 20)
        answer = ask_usage(proxy, fake, jwt({"exp": time.time() + 60, "sub": "client"}), "acct-client")
        assert answer.status == 200
        doc = json.loads(answer.body)
        assert doc["rate_limit"]["allowed"] is True and doc["rate_limit"]["limit_reached"] is False
        assert doc["rate_limit"]["primary_window"]["used_percent"] == 20  # a's window, not the own 100 %
        assert doc["codex_failover"]["served_by"] == "a" and answer.headers["x-codex-failover-usage"] == "a"
        assert doc["additional_rate_limits"][0]["limit_name"] == "pool: a"
        assert not {"email", "user_id", "account_id"} & set(doc), doc  # a's identity is not Codex's business
        asked = [r["credential"] for r in fake.requests() if r.get("scenario") == "usage"]
        assert asked == ["acct-client", "acct-a"]  # the own account (passed through), then a with its own token
        ask_usage(proxy, fake, jwt({"exp": time.time() + 60, "sub": "client"}), "acct-client")
        assert [r["credential"] for r in fake.requests() if r.get("scenario") == "usage"][2:] == ["acct-client"]  # a cached
        assert "answered with credential a's" in proxy.log()
    finally:
        proxy.stop()


def test_an_own_account_with_headroom_gets_its_own_answer_as_it_is(fake, tmp_path):
    proxy, _ = start(fake, tmp_path)
    try:
        set_usage(fake, "acct-client", 30)
        answer = ask_usage(proxy, fake, jwt({"exp": time.time() + 60, "sub": "client"}), "acct-client")
        doc = json.loads(answer.body)
        assert doc["rate_limit"]["primary_window"]["used_percent"] == 30 and "codex_failover" not in doc
        assert [r["credential"] for r in fake.requests() if r.get("scenario") == "usage"] == ["acct-client"]
    finally:
        proxy.stop()


def test_a_limited_own_account_with_the_whole_pool_limited_gets_its_own_answer(fake, tmp_path):
    proxy, _ = start(fake, tmp_path)
    try:
        for account in ("acct-client", "acct-a", "acct-b"):
            set_usage(fake, account, 100)
        doc = json.loads(ask_usage(proxy, fake, jwt({"exp": time.time() + 60, "sub": "client"}), "acct-client").body)
        assert doc["rate_limit"]["limit_reached"] is True and "codex_failover" not in doc
    finally:
        proxy.stop()
