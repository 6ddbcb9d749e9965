"""End to end in a real browser: the dashboard at `http://codex-failover.status/` as a person leaves it
open. A ChatGPT client whose own account is at its usage limit sends one request; the proxy moves it
to pooled account `a`, which is overloaded, then to `b`, which serves; `c` is a spare nobody used.
Headless Chromium (the system one, as tests/test_mitmweb_browser.py drives it) opens the page through
the proxy and reads: every account with its state and why, the usage bars of every account that may
send (the unused `c`'s too: asked of its usage endpoint), the failover in the recent requests, the
counts. Its reset button ends `a`'s rest; the same request from another origin's page cannot.

Screenshots in light and dark go to the test's temporary directory;
`CODEX_FAILOVER_UPDATE_SCREENSHOT=1` rewrites docs/dashboard.png and docs/dashboard-dark.png.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import threading
import time

import pytest
from harness import ROOT, ProxyProcess, post_responses, proxy_status, request, wait_until
from test_mitmweb_browser import CHROMIUM, _playwright_or_skip

pytestmark = pytest.mark.e2e
TIMEOUT_MS = 10_000
VIEWPORT = {"width": 1280, "height": 900}


def jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


@contextlib.contextmanager
def elsewhere():
    """Another origin: a web server on loopback (Chromium reaches loopback without the proxy)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"<html><body>elsewhere</body></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


@pytest.fixture(scope="module")
def sync_api():
    return _playwright_or_skip()


@pytest.fixture
def session(fake, tmp_path):
    """The proxy after the one request that moved twice: (proxy, fake, the client's token)."""
    lines = ["credentials:"]
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens": {"access_token": jwt({"exp": time.time() + 4 * 86400, "sub": name}),
                                               "account_id": f"acct-{name}"}}))
        lines += [f"  - name: {name}", f"    auth_file: {path}", f"    base_url: {fake.base}/backend-api/codex"]
    lines += ["policy:", "  bootstrap_timeout: 5s", "  selection: fill-first"]
    proxy = ProxyProcess(tmp_path, "\n".join(lines) + "\n")
    try:
        fake.overload_next("acct-client", 1, "usage-limit")
        fake.overload_next("acct-a", 1, "usage-limit")
        token = jwt({"exp": time.time() + 3600})
        reply = post_responses(proxy.port, f"{fake.base}/backend-api/codex/responses", token,
                               headers={"chatgpt-account-id": "acct-client", "session-id": "session-one"})
        assert reply.status == 200, reply.body[:300]
        assert fake.model_requests()[-1]["credential"] == "acct-b"
        # A second Codex session, logged in to an account of its own that is not limited: its own turn.
        reply = post_responses(proxy.port, f"{fake.base}/backend-api/codex/responses", jwt({"exp": time.time() + 3600}),
                               headers={"chatgpt-account-id": "acct-mine", "session-id": "session-two"})
        assert reply.status == 200 and fake.model_requests()[-1]["credential"] == "acct-mine", reply.body[:300]
        yield proxy, fake
    finally:
        proxy.stop()


def test_scripts_still_get_the_json(session):
    proxy, _ = session
    doc = proxy_status(proxy.port)  # no Accept: text/html
    assert {c["name"]: c["state"] for c in doc["credentials"]} == {"a": "cooling", "b": "ready", "c": "ready"}
    assert doc["counts"] == {"requests": 2, "served": 2, "moved_away": 1, "not_served": 0,
                             "rejections": {"usage_limit": 2}}
    assert [a["credential"] for a in doc["recent"][1]["attempts"]] == ["client", "a", "b"]
    assert doc["recent"][0]["session"] != doc["recent"][1]["session"]
    html = request(proxy.port, "GET", "http://codex-failover.status/", {"accept": "text/html,*/*;q=0.8"})
    assert html.headers["content-type"].startswith("text/html")
    csp = html.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert b"<script src=\"/dashboard.js\"" in html.body and b"http" not in html.body.split(b"<footer")[0].lower()


def test_the_dashboard_in_a_browser(session, sync_api, tmp_path):
    proxy, fake = session
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=15_000,
                                     proxy={"server": f"http://127.0.0.1:{proxy.port}"},
                                     args=["--disable-background-networking", "--disable-component-update"])
        try:
            for scheme in ("light", "dark"):
                context = browser.new_context(viewport=VIEWPORT, color_scheme=scheme, device_scale_factor=1)
                page = context.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                problems: list[str] = []
                page.on("console", lambda m, seen=problems: seen.append(m.text) if m.type in ("error", "warning") else None)
                page.on("pageerror", lambda e, seen=problems: seen.append(str(e)))
                page.goto("http://codex-failover.status/")
                cards = page.locator(".card")
                sync_api.expect(cards).to_have_count(5, timeout=TIMEOUT_MS)
                # The footer's command names the proxy this page came through, not a default port.
                sync_api.expect(page.locator("#as-json")).to_have_text(
                    f"curl -x http://127.0.0.1:{proxy.port} http://codex-failover.status/")
                # Every account that may send shows both windows, the unused spare's too (asked of its
                # usage endpoint while the page is open) and the second session's own account (asked with
                # the token of its last request); the resting ones say why and for how long.
                mine = page.locator(".card", has_text="own account (account …mine)")
                sync_api.expect(mine.locator(".window")).to_have_count(2, timeout=TIMEOUT_MS)
                sync_api.expect(mine).to_contain_text("in rotation")
                for name in ("b", "c"):
                    card = page.locator(f".card[data-name='{name}']")
                    sync_api.expect(card.locator(".window")).to_have_count(2, timeout=TIMEOUT_MS)
                    sync_api.expect(card).to_contain_text("5-hour")
                    sync_api.expect(card).to_contain_text("weekly")
                    sync_api.expect(card).to_contain_text("token expires in")
                a = page.locator(".card[data-name='a']")
                sync_api.expect(a.locator(".badge")).to_contain_text("cooling")
                sync_api.expect(a).to_contain_text("resting: usage_limit")
                own = page.locator(".card", has_text="own account (account …ient)")
                sync_api.expect(own).to_contain_text("resting: usage_limit")
                sync_api.expect(own.locator(".badge")).to_contain_text("left")
                row = page.locator("#recent tr").nth(1)
                sync_api.expect(row).to_contain_text("served by b (moved)")
                sync_api.expect(row).to_contain_text("client: failover (usage_limit)")
                sync_api.expect(row).to_contain_text("a: failover (usage_limit)")
                sync_api.expect(row).to_contain_text("ms")
                sync_api.expect(page.locator("#counts")).to_contain_text("moved away")
                assert page.locator("#internals").text_content().count("relay_port") == 1
                page.wait_for_timeout(300)
                shot = tmp_path / f"dashboard-{scheme}.png"
                page.screenshot(path=str(shot), full_page=True)
                if os.environ.get("CODEX_FAILOVER_UPDATE_SCREENSHOT"):
                    name = "dashboard.png" if scheme == "light" else "dashboard-dark.png"
                    page.screenshot(path=str(ROOT / "docs" / name), full_page=True)
                assert problems == [], problems  # no CSP violation, no script error
                context.close()
            asked = {r["credential"] for r in fake.requests() if r.get("scenario") == "usage"}
            assert {"acct-b", "acct-c", "acct-mine"} <= asked and "acct-a" not in asked and "acct-client" not in asked

            # Another origin's page (a local web server's) sends the button's request: the browser's
            # preflight is not answered for it, so the POST never leaves and `a` keeps resting.
            # (Not a page.route: Playwright answers the preflights of a page it intercepts itself.)
            with elsewhere() as origin:
                context = browser.new_context()
                page = context.new_page()
                page.goto(origin)
                result = page.evaluate("""async () => {
                    try {
                        const r = await fetch("http://codex-failover.status/reset/a",
                                              {method: "POST", headers: {"X-Codex-Failover": "1"}});
                        return "sent " + r.status;
                    } catch (e) { return "blocked"; }
                }""")
            assert result == "blocked"
            assert {c["name"]: c["state"] for c in proxy_status(proxy.port)["credentials"]}["a"] == "cooling"
            context.close()

            # The user's own press ends it.
            context = browser.new_context(viewport=VIEWPORT)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto("http://codex-failover.status/")
            page.locator("button[data-reset='a']").click()
            sync_api.expect(page.locator(".card[data-name='a'] .badge")).to_contain_text("ready")
            wait_until(lambda: "credential a: cooldown ended (ended by hand" in proxy.log(), 5, "the reset's log line")
            # And the own account's (a client's: named by its label's tail).
            own = page.locator(".card", has_text="own account (account …ient)")
            own.locator("button[data-reset='ient']").click()
            sync_api.expect(own.locator(".badge")).to_contain_text("ready")
            context.close()
        finally:
            browser.close()
