"""End to end: the pool serves the user's own programs only (issue 26). A web page in a browser that
goes through the proxy, a process of another user, another key naming a pooled session, and a key the
upstream refused are never served from the pool; a request kind the pool has nothing for is told so;
mitmproxy's --proxyauth works with the addon. Real mitmdump, the fake upstream, Debian's Chromium, all
on this host's loopback."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import uuid

import pytest
from harness import (
    FakeUpstreamProcess,
    ProxyProcess,
    WsClient,
    WsRejected,
    free_port,
    pool_yaml,
    post_responses,
    served_by,
    wait_until,
)

pytestmark = pytest.mark.e2e

SPARE = "sk-test-spare-good"  # the pooled key; the fake names it in its answers
JUNK_503 = "sk-junk-http-503"  # a key the upstream answers 503 (a failover class)
CHROMIUM = os.environ.get("CODEX_FAILOVER_CHROMIUM", "/usr/bin/chromium")
BODY = {"model": "gpt-fake", "stream": True, "input": [], "store": False}


def proxy_for(tmp, fake, extra=None, env=None, **policy) -> ProxyProcess:
    # The model endpoint is named `localhost` so a browser sends it through the proxy as any host.
    text, pool_env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)], **policy)
    return ProxyProcess(tmp, text, {**pool_env, **(env or {})}, extra=extra)


def spare_requests(fake: FakeUpstreamProcess) -> list[dict]:
    return [r for r in fake.model_requests() if r["credential"] == SPARE]


@pytest.fixture
def fake(tmp_path):
    upstream = FakeUpstreamProcess(tmp_path / "fake")
    yield upstream
    upstream.stop()


# -- a web page in the browser -----------------------------------------------------------------

PAGE = b"""<!doctype html><title>another origin</title><p>a page that spends someone's pool</p>"""


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args):
        pass


@pytest.fixture
def page_origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def sync_api():
    try:
        from playwright import sync_api
    except ImportError:
        pytest.skip("playwright is not installed (scripts/setup test installs pyproject's test extra)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup-system installs it)")
    return sync_api


FETCH = """async ([url, key]) => {
  const r = await fetch(url, {method: "POST", body: JSON.stringify({model: "gpt-fake", stream: true, input: []}),
                              headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"}});
  return {status: r.status, text: await r.text()};
}"""


@pytest.mark.parametrize("use_client_credential", [True, False])
def test_a_web_page_never_spends_the_pool(tmp_path, fake, page_origin, sync_api, use_client_credential):
    proxy = proxy_for(tmp_path, fake, use_client_credential=use_client_credential)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=15_000,
                                         args=[f"--proxy-server=http://127.0.0.1:{proxy.port}",
                                               "--proxy-bypass-list=<-loopback>"])  # loopback through it too
            try:
                page = browser.new_page()
                page.goto(page_origin + "/", timeout=15_000)
                got = page.evaluate(FETCH, [f"http://localhost:{fake.port}/v1/responses", JUNK_503])
            finally:
                browser.close()
        # The page got the upstream's own answer to its own key (503), and the pool was never used.
        assert got["status"] == 503, got
        assert "Hello from" not in got["text"]
        assert spare_requests(fake) == []
        seen = fake.requests()
        assert any(r.get("method") == "OPTIONS" for r in seen), "the CORS preflight was passed through"
        junk = [r for r in fake.model_requests() if r["scenario"] == "http-503"]
        assert len(junk) == 1, seen  # sent once, as it was: not held, not retried
    finally:
        proxy.stop()


@pytest.mark.parametrize("websocket", ["downgrade", "gate"])
def test_a_web_pages_websocket_is_passed_through(tmp_path, fake, websocket):
    """A page's WebSocket carries Origin: neither the gate (which would open it on the pool) nor the
    downgrade (a 426 meant for Codex) applies; it reaches the upstream on its own key."""
    proxy = proxy_for(tmp_path, fake, extra=["--set", f"failover_websocket={websocket}"])
    try:
        got = WsClient.connect(proxy.port, f"http://localhost:{fake.port}/v1/responses",
                               {"authorization": f"Bearer {JUNK_503}", "origin": "https://evil.example"})
        assert isinstance(got, WsRejected) and got.status == 503, got  # the upstream's own answer to its key
        assert spare_requests(fake) == []
    finally:
        proxy.stop()


# -- a process of another user ----------------------------------------------------------------

def _setpriv_or_skip() -> list[str]:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("curl"):
        pytest.skip("needs root, setpriv and curl to run a client as another user")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def curl(prefix: list[str], proxy: int | None, url: str, *args: str) -> tuple[int, str]:
    cmd = [*prefix, "curl", "-s", "-m", "20", "-o", "-", "-w", "\n%{http_code}", *args]
    if proxy is not None:
        cmd += ["-x", f"http://127.0.0.1:{proxy}"]
    done = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=30)
    body, _, code = done.stdout.rpartition("\n")
    return int(code or 0), body


def test_another_user_gets_no_pool_no_status_page_and_no_metrics(tmp_path, fake):
    nobody = _setpriv_or_skip()
    metrics = free_port()
    proxy = proxy_for(tmp_path, fake, extra=["--set", f"failover_metrics=127.0.0.1:{metrics}"],
                      use_client_credential=False)
    try:
        post = ("-H", f"authorization: Bearer {JUNK_503}", "-H", "content-type: application/json",
                "--data", json.dumps(BODY))
        url = f"http://localhost:{fake.port}/v1/responses"
        # Another user: its own key goes upstream as it is, and gets the upstream's 503.
        status, body = curl(nobody, proxy.port, url, *post)
        assert status == 503 and "Hello from" not in body, body
        assert spare_requests(fake) == []
        assert curl(nobody, proxy.port, "http://codex-failover.status/")[0] == 403
        assert curl(nobody, None, f"http://127.0.0.1:{metrics}/metrics")[0] == 403
        # The proxy's own user: the pool serves it (pool-only mode), and it sees the status and metrics.
        status, body = curl([], proxy.port, url, *post)
        assert status == 200 and f"Hello from {SPARE}" in body, body
        mine, page = curl([], proxy.port, "http://codex-failover.status/")
        assert mine == 200 and "spare" in page
        assert curl([], None, f"http://127.0.0.1:{metrics}/metrics")[0] == 200
        assert f"local clients: processes of uid {os.geteuid()} only" in proxy.log()
    finally:
        proxy.stop()


# -- a borrowed session -----------------------------------------------------------------------

def test_another_key_naming_a_pooled_session_does_not_ride_it(tmp_path, fake):
    proxy = proxy_for(tmp_path, fake)
    try:
        url = f"http://localhost:{fake.port}/v1/responses"
        session = {"session-id": f"thread-{uuid.uuid4()}"}
        first = post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY, headers=session)
        assert first.status == 200 and served_by(first) == SPARE, first.body[-300:]  # the session now sticks to spare
        again = post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY, headers=session)
        assert served_by(again) == SPARE  # its own key's session: spare first, as before
        other = post_responses(proxy.port, url, "sk-test-other-good", BODY, headers=session)
        assert other.status == 200 and served_by(other) == "sk-test-other-good", other.body[-300:]
    finally:
        proxy.stop()


# -- a key the upstream refused ---------------------------------------------------------------

REFUSED = "sk-test-junk-unauthorized"  # the fake answers it 401


def test_a_refused_key_is_not_served_from_the_pool_afterwards(tmp_path, fake):
    proxy = proxy_for(tmp_path, fake)
    try:
        url = f"http://localhost:{fake.port}/v1/responses"
        assert post_responses(proxy.port, url, REFUSED, BODY).status == 401  # its own answer, as before
        fake.overload_next(REFUSED, scenario="http-503")  # now the upstream answers it a failover class
        retried = post_responses(proxy.port, url, REFUSED, BODY)
        assert retried.status == 503 and served_by(retried) is None, retried.body[-300:]
        assert spare_requests(fake) == []
        assert "was refused by the upstream: not lent the pool" in proxy.log()
        assert REFUSED not in proxy.log()
    finally:
        proxy.stop()


def test_in_pool_only_mode_a_refused_key_stays_refused(tmp_path, fake):
    proxy = proxy_for(tmp_path, fake, use_client_credential=False)
    try:
        url = f"http://localhost:{fake.port}/v1/responses"
        pinned = {**BODY, "previous_response_id": "resp_1"}  # stays on its own credential
        assert post_responses(proxy.port, url, REFUSED, pinned).status == 401
        retried = post_responses(proxy.port, url, REFUSED, BODY)  # movable: the pool would serve it
        assert retried.status == 401 and served_by(retried) is None, retried.body[-300:]
        assert spare_requests(fake) == []
        # A key the upstream never refused still gets the pool.
        assert served_by(post_responses(proxy.port, url, "sk-test-fine", BODY)) == SPARE
    finally:
        proxy.stop()


# -- a request kind the pool has nothing for --------------------------------------------------

def test_pool_only_mode_says_when_no_pooled_credential_serves_the_request_kind(tmp_path, fake):
    auth = tmp_path / "work.json"
    auth.write_text(json.dumps({"tokens": {"access_token": "hdr.payload.sig", "account_id": "acct-work"}}))
    text = (f"credentials:\n  - name: work\n    auth_file: {auth}\n    base_url: http://localhost:{fake.port}/v1\n"
            "policy:\n  use_client_credential: false\n")
    proxy = ProxyProcess(tmp_path, text)
    try:
        reply = post_responses(proxy.port, f"http://localhost:{fake.port}/v1/responses", "sk-test-apikey", BODY)
        assert reply.status == 503, reply.body
        error = reply.json()["error"]
        assert error["code"] == "no_pool_credential_for_request", error
        assert "no pooled credential serves API-key requests" in error["message"]
        assert "cooling" not in error["message"]
        assert fake.model_requests() == []
    finally:
        proxy.stop()


# -- the proxy token ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine", [None, "engine"])
def test_a_clients_proxy_authorization_never_reaches_the_model_host_without_proxyauth_either(tmp_path, fake, engine):
    """Plain http through the proxy (the header rides on the request itself): the client's token for a
    proxy goes to no attempt, on the kept connections or the engine's fallback."""
    proxy = proxy_for(tmp_path, fake, env={"CODEX_FAILOVER_FALLBACK": engine} if engine else None)
    try:
        url = f"http://localhost:{fake.port}/v1/responses"
        token = {"proxy-authorization": "Basic " + __import__("base64").b64encode(b"me:other-proxy").decode()}
        reply = post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY, headers=token)
        assert reply.status == 200 and served_by(reply) == SPARE, reply.body[-300:]
        assert [r.get("proxy_authorization") for r in fake.model_requests()] == [False, False]
    finally:
        proxy.stop()


def test_proxyauth_works_with_the_addon(tmp_path, fake):
    proxy = proxy_for(tmp_path, fake, extra=["--proxyauth", "me:s3cr3t-token"])
    try:
        url = f"http://localhost:{fake.port}/v1/responses"
        assert post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY).status == 407
        token = {"proxy-authorization": "Basic " + __import__("base64").b64encode(b"me:s3cr3t-token").decode()}
        reply = post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY, headers=token)
        assert reply.status == 200 and served_by(reply) == SPARE, reply.body[-300:]  # failover, with the token
        assert not any(r.get("proxy_authorization") for r in fake.model_requests())  # the token stays here
        code, _ = curl([], None, "http://codex-failover.status/", "-x", f"http://me:s3cr3t-token@127.0.0.1:{proxy.port}")
        assert code == 200
        wait_until(lambda: "holders of the proxy token" in proxy.log(), 5, "the start-up line")
        assert "s3cr3t-token" not in proxy.log()
    finally:
        proxy.stop()
