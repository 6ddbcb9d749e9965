"""End to end in a real browser: what a person sees of a failover in mitmweb's UI.

One failover (the client's own key is overloaded in-stream, the addon replays on "spare", which serves)
runs through a real `mitmweb -s addon/failover.py`; headless Chromium (Playwright driving the system
`/usr/bin/chromium`, never a downloaded browser) opens mitmweb's UI and reads it as a person would: the
flow list, the marks, each attempt's Response, Error and Comment tabs, the client flow's story, and the
headers. docs/mitmweb.md walks through the same views. The API's view is tests/test_e2e_saved_flows.py.
A second mitmweb serves one request from its own credential: one flow, the client's, marked served.

The marks must be drawn as colour emoji, not as empty boxes: see `assert_drawn_as_colour_emoji`.

Skipped, with the reason, when Playwright or Chromium is missing, except in CI (`CI` set), where that
fails: `scripts/setup-system` installs Chromium and the emoji font, `scripts/setup test` Playwright.
`CODEX_FAILOVER_CHROMIUM` names another Chromium. `CODEX_FAILOVER_UPDATE_SCREENSHOT=1` rewrites
docs/mitmweb-failover.png; the same picture and a picture of every test's last view always go to the
test's temporary directory.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
from pathlib import Path

import pytest
from harness import ROOT, FakeUpstreamProcess, MitmwebProcess, pool_yaml, post_responses, wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("CODEX_FAILOVER_CHROMIUM", "/usr/bin/chromium")
DOCS_SCREENSHOT = ROOT / "docs" / "mitmweb-failover.png"
VIEWPORT = {"width": 1400, "height": 800}
SCREENSHOT_SIZE = {"width": 1400, "height": 640}
SCREENSHOT_SPLIT = 440  # px from the left: the details pane wide enough for the rejection's code
TIMEOUT_MS = 10_000  # every wait in the browser; none is expected to take more than a second

# Keys the fake upstream does not echo (it names keys outside `sk-test` by a hash): any trace is a leak.
CLIENT_KEY = "sk-proj-CLIENTSECRET1-overload"
SPARE_KEY = "sk-proj-SPARESECRET2-good"
SPARE_LABEL = "tok-" + hashlib.sha256(SPARE_KEY.encode()).hexdigest()[:8]  # what the fake's answer names
REDACTED = "<redacted by codex-failover>"

SERVED, REJECTED = "✅", "❌"  # :white_check_mark:, :x:
STORY = "failover: 2 attempts, served by spare after overloaded"


def _playwright_or_skip():
    """Playwright's sync API, or a skip (a failure in CI) saying what is missing."""
    missing = []
    try:
        from playwright import sync_api
    except ImportError:
        sync_api = None
        missing.append("playwright is not installed (scripts/setup test installs pyproject's test extra)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"no Chromium at {CHROMIUM} (scripts/setup-system installs it; "
                       "CODEX_FAILOVER_CHROMIUM names another)")
    if missing:
        reason = "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}", pytrace=False)
        pytest.skip(reason)
    return sync_api


@pytest.fixture(scope="module")
def sync_api():
    return _playwright_or_skip()


@contextlib.contextmanager
def mitmweb_after_one_request(tmp: Path, client_key: str):
    """A mitmweb (with "spare" in its pool) that served one Codex request on `client_key`."""
    fake = FakeUpstreamProcess(tmp)
    try:
        text, env = pool_yaml(fake.base, [("spare", SPARE_KEY)])
        web = MitmwebProcess(tmp, text, env)
        try:
            reply = post_responses(web.port, f"{fake.base}/v1/responses", client_key)
            assert reply.status == 200, reply.body[-500:]
            assert reply.events()[-1]["type"] == "response.completed", reply.body[-500:]
            yield web
        finally:
            web.stop()
    finally:
        fake.stop()


@pytest.fixture(scope="module")
def mitmweb(tmp_path_factory, sync_api):
    """mitmweb after one failover: three flows, the client's and two attempts."""
    with mitmweb_after_one_request(tmp_path_factory.mktemp("mitmweb-browser"), CLIENT_KEY) as web:
        yield web


@pytest.fixture(scope="module")
def browser(sync_api):
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=15_000)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, mitmweb, sync_api, tmp_path, request):
    """mitmweb's UI, logged in, with all three flows listed."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.set_default_navigation_timeout(TIMEOUT_MS)
    sync_api.expect.set_options(timeout=TIMEOUT_MS)
    try:
        page.goto(mitmweb.url)
        expect(rows(page)).to_have_count(3)
        yield page
    finally:
        with contextlib.suppress(Exception):  # for debugging: the test's last view
            page.screenshot(path=str(tmp_path / f"last-{request.node.name}.png"), timeout=TIMEOUT_MS)
        context.close()


def expect(locator):
    """Playwright's expect (imported here: the module loads, and skips, without Playwright)."""
    from playwright.sync_api import expect as playwright_expect
    return playwright_expect(locator)


# --- mitmweb's UI, as found in its DOM (mitmweb 12.3.1) ---

def rows(page):
    """The flow list's rows (the table's spacer rows hold no request)."""
    return page.locator("tbody tr.has-request")


def row_marked(page, mark: str):
    return rows(page).filter(has=page.locator("span.marker", has_text=mark))


def client_row(page):
    """The client's own flow: the one row without the "Replayed request" icon (every attempt is a replay)."""
    return rows(page).filter(has_not=page.locator("td.col-path .icon-replay"))


def detail(page):
    return page.locator(".flow-detail")


def tab(page, name: str):
    """A tab of the selected flow's details (Request, Response, Error, Connection, Timing, Comment)."""
    return detail(page).locator("nav.nav-tabs").get_by_role("link", name=name, exact=True)


def open_tab(page, name: str):
    tab(page, name).click()
    expect(tab(page, name)).to_have_class(re.compile(r"\bactive\b"))


def body_lines(page) -> list[str]:
    """The lines of the selected message's body as the content view shows them, blank ones left out."""
    view = detail(page).locator(".contentview pre")
    expect(view).to_be_visible()
    return [line.strip() for line in view.locator(":scope > div").all_inner_texts() if line.strip()]


def comment(page):
    return detail(page).locator("section:has(> h4:text-is('Comment')) .kv-value")


def header_value(page, name: str) -> str:
    row = detail(page).locator(".kv-row").filter(has=page.locator(".kv-key", has_text=re.compile(f"^{name}$", re.I)))
    expect(row).to_have_count(1)
    return row.locator(".kv-value").inner_text()


def assert_no_secret(page) -> None:
    html = page.content()
    for secret in (CLIENT_KEY, SPARE_KEY, "SECRET"):
        assert secret not in html, f"{secret} is on the page"


# --- the emoji check ---

# Counts the pixels of a PNG (decoded by the browser itself, so the test needs no image library) by
# colour: strongly saturated red, strongly saturated green, other saturated, and dark grey (what an
# empty box or a monochrome fallback glyph is drawn with: the text colour).
_COUNT_COLOURS = """async (b64) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + b64;
  await img.decode();
  const canvas = document.createElement('canvas');
  canvas.width = img.width; canvas.height = img.height;
  const ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, img.width, img.height).data;
  const n = {red: 0, green: 0, other: 0, grey: 0};
  for (let i = 0; i < d.length; i += 4) {
    const r = d[i], g = d[i + 1], b = d[i + 2];
    if (Math.max(r, g, b) - Math.min(r, g, b) < 80) { if (Math.max(r, g, b) < 160) n.grey++; continue; }
    if (r - Math.max(g, b) >= 80) n.red++;
    else if (g - Math.max(r, b) >= 40) n.green++;
    else n.other++;
  }
  return n;
}"""

_HUES = {SERVED: "green", REJECTED: "red"}
_MIN_PIXELS = 30  # a 16 px Noto Color Emoji ✅ has ~170 green pixels, ❌ ~115 red ones


def platform_fonts(page, mark: str) -> list[dict]:
    """The fonts Chromium really drew the flow list's `mark` with (DevTools' CSS.getPlatformFontsForNode)."""
    cdp = page.context.new_cdp_session(page)
    try:
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        cdp.send("DOM.getDocument", {"depth": 0})
        found = cdp.send("Runtime.evaluate", {"expression": (
            f"[...document.querySelectorAll('tbody span.marker')].find(e => e.textContent === {mark!r})"
            ".firstChild")})
        assert "objectId" in found["result"], f"no {mark} marker text on the page"
        node = cdp.send("DOM.requestNode", {"objectId": found["result"]["objectId"]})["nodeId"]
        return cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    finally:
        cdp.detach()


def assert_drawn_as_colour_emoji(page, mark: str) -> None:
    """The row's mark reads `mark` and is drawn as a colour emoji, not as an empty box ("tofu").

    Two independent checks. (1) Chromium's own account of the fonts it shaped the mark's text with
    (DevTools CSS.getPlatformFontsForNode) names only emoji fonts (Noto Color Emoji here; Apple Color
    Emoji, Segoe UI Emoji elsewhere): without one, the glyph comes from a text font or the last-resort
    box. (2) What was drawn: a screenshot of the mark's element holds at least _MIN_PIXELS strongly
    saturated pixels of the mark's own colour (✅ green, ❌ red), and they are most of its coloured
    pixels. An empty box or a monochrome fallback glyph is drawn in the text colour, dark grey, with no
    saturated pixel at all; the row's background is white or a pale blue, far below the threshold.
    """
    marker = row_marked(page, mark).locator("span.marker")
    expect(marker).to_have_text(mark)
    fonts = platform_fonts(page, mark)
    assert fonts, (
        f"{mark} is drawn with {[f['familyName'] for f in fonts]}, not a colour emoji font: "
        "install one (scripts/setup-system installs fonts-noto-color-emoji)")
    assert all("emoji" in f["familyName"].lower() for f in fonts), (
        f"{mark} is drawn with {[f['familyName'] for f in fonts]}, not a colour emoji font: "
        "install one (scripts/setup-system installs fonts-noto-color-emoji)")
    png = marker.screenshot()
    counts = page.evaluate(_COUNT_COLOURS, base64.b64encode(png).decode())
    hue = _HUES[mark]
    coloured = counts["red"] + counts["green"] + counts["other"]
    assert counts[hue] >= _MIN_PIXELS, (
        f"{mark} is not drawn as a {hue} emoji (pixels by colour: {counts}): an empty box or a monochrome glyph")
    assert counts[hue] >= 0.8 * coloured, (
        f"{mark} is not drawn as a {hue} emoji (pixels by colour: {counts}): an empty box or a monochrome glyph")


# --- the tests ---

def test_the_flow_list_shows_the_client_flow_and_both_attempts_with_emoji_marks(page):
    expect(rows(page)).to_have_count(3)
    expect(client_row(page)).to_have_count(1)
    expect(row_marked(page, REJECTED)).to_have_count(1)
    expect(row_marked(page, SERVED)).to_have_count(1)
    assert_drawn_as_colour_emoji(page, REJECTED)
    assert_drawn_as_colour_emoji(page, SERVED)
    # Only the loser carries mitmweb's error triangle; its tooltip is the addon's error.
    expect(rows(page).locator("td.col-path .icon-warning")).to_have_count(1)
    expect(row_marked(page, REJECTED).locator(".icon-warning title")).to_have_text(
        "codex-failover: rejected: overloaded")
    assert_no_secret(page)


def test_the_losing_attempt_shows_the_rejection_it_received_and_why_it_lost(page, tmp_path):
    row_marked(page, REJECTED).click()
    open_tab(page, "Response")
    expect(detail(page).locator(".contentview pre")).to_contain_text("server_is_overloaded")
    lines = body_lines(page)
    # Its body is what it received, up to and including the rejection event.
    assert lines[-2] == "event: error", lines
    assert lines[-1].startswith('data: {"type":"error"'), lines
    assert '"code":"server_is_overloaded"' in lines[-1], lines
    save_screenshot(page, tmp_path)

    open_tab(page, "Error")
    error = detail(page).locator("section.error .alert")
    expect(error).to_be_visible()
    assert error.inner_text().splitlines()[0] == "codex-failover: rejected: overloaded"  # not a protocol error

    open_tab(page, "Comment")
    expect(comment(page)).to_have_text(re.compile(
        r"^attempt 1/2: client via direct: failover \(overloaded\), HTTP 200, \d+ ms \(codex-failover [0-9a-z]{4}-r\d+\)$"))
    assert_no_secret(page)


def test_the_winning_attempt_shows_the_answer_and_no_error(page):
    row_marked(page, SERVED).click()
    open_tab(page, "Response")
    expect(detail(page).locator(".contentview pre")).to_contain_text(f"Hello from {SPARE_LABEL}")
    assert body_lines(page)[-2] == "event: response.completed"
    expect(tab(page, "Error")).to_have_count(0)
    expect(detail(page).locator("section.error")).to_have_count(0)
    expect(row_marked(page, SERVED).locator(".icon-warning")).to_have_count(0)
    open_tab(page, "Comment")
    expect(comment(page)).to_have_text(re.compile(
        r"^attempt 2/2: spare via direct: commit \(output\), HTTP 200, \d+ ms \(codex-failover [0-9a-z]{4}-r\d+\)$"))
    assert_no_secret(page)


def test_the_client_flows_comment_tells_the_whole_story(page):
    client_row(page).click()
    expect(tab(page, "Error")).to_have_count(0)
    open_tab(page, "Comment")
    shown = comment(page)
    expect(shown).to_have_text(re.compile("^" + re.escape(STORY)))
    assert shown.inner_text().startswith(STORY)  # what is rendered (mitmweb runs the lines together)
    lines = shown.text_content().splitlines()  # what the comment holds: one line per attempt
    assert lines[0] == STORY, lines
    assert re.fullmatch(r"• [0-9a-z]{4}-r\d+ attempt 1: client via direct: failover \(overloaded\), HTTP 200, \d+ ms", lines[1]), lines
    assert re.fullmatch(r"• [0-9a-z]{4}-r\d+ attempt 2: spare via direct: commit \(output\), HTTP 200, \d+ ms", lines[2]), lines
    assert len(lines) == 3, lines
    open_tab(page, "Response")
    expect(detail(page).locator(".contentview pre")).to_contain_text(f"Hello from {SPARE_LABEL}")
    assert_no_secret(page)


def test_no_flow_shows_a_secret(page):
    for row in (client_row(page), row_marked(page, REJECTED), row_marked(page, SERVED)):
        row.click()
        open_tab(page, "Request")
        assert header_value(page, "authorization") == REDACTED
        assert_no_secret(page)


# Is `text` (in one line of the content view) inside the view's visible box, not cut off at its right?
_IN_VIEW = """(pre, text) => {
  const line = [...pre.children].find(d => d.textContent.includes(text));
  const node = line.firstChild, at = node.textContent.indexOf(text);
  const range = document.createRange();
  range.setStart(node, at);
  range.setEnd(node, at + text.length);
  const r = range.getBoundingClientRect(), box = pre.getBoundingClientRect();
  return r.left >= box.left && r.right <= box.right && r.top >= box.top && r.bottom <= box.bottom;
}"""


def save_screenshot(page, tmp_path: Path) -> None:
    """The flow list with the losing attempt's Response tab open, the details pane widened so the
    rejection's code shows: always to tmp_path, to docs/mitmweb-failover.png when
    CODEX_FAILOVER_UPDATE_SCREENSHOT=1."""
    page.set_viewport_size(SCREENSHOT_SIZE)  # the bottom of the page is empty
    handle = page.locator(".splitter.splitter-x > div")  # between the flow list and the details
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(SCREENSHOT_SPLIT, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    page.mouse.move(0, SCREENSHOT_SIZE["height"] - 1)  # no hover highlight
    pre = detail(page).locator(".contentview pre")
    assert pre.evaluate(_IN_VIEW, "server_is_overloaded"), "the picture would not show the rejection's code"
    shot = tmp_path / "mitmweb-failover.png"
    page.screenshot(path=str(shot))
    if os.environ.get("CODEX_FAILOVER_UPDATE_SCREENSHOT") == "1":
        DOCS_SCREENSHOT.write_bytes(shot.read_bytes())


HEALTHY_KEY = "sk-proj-CLIENTSECRET3-good"


@pytest.fixture(scope="module")
def healthy_web(tmp_path_factory, sync_api):
    """mitmweb after one request its own credential served (attempt 1, direct)."""
    with mitmweb_after_one_request(tmp_path_factory.mktemp("mitmweb-healthy"), HEALTHY_KEY) as web:
        yield web


def test_a_request_its_first_attempt_served_is_one_flow_the_clients_marked_served(browser, healthy_web, tmp_path):
    """No second flow repeats the exchange: the client's flow carried attempt 1 (docs/mitmweb.md)."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(healthy_web.url)
        expect(rows(page)).to_have_count(1)
        expect(client_row(page)).to_have_count(1)
        expect(row_marked(page, SERVED)).to_have_count(1)
        assert_drawn_as_colour_emoji(page, SERVED)
        client_row(page).click()
        expect(tab(page, "Error")).to_have_count(0)
        open_tab(page, "Comment")
        lines = comment(page).text_content().splitlines()
        assert any(re.fullmatch(r"• [0-9a-z]{4}-r\d+ attempt 1: client via direct: commit \(output\), HTTP 200, \d+ ms",
                                line) for line in lines), lines
        open_tab(page, "Response")
        expect(detail(page).locator(".contentview pre")).to_contain_text("response.completed")
        assert HEALTHY_KEY not in page.content()
        page.screenshot(path=str(tmp_path / "mitmweb-healthy.png"))
    finally:
        context.close()


def test_failover_view_models_lists_only_the_model_flows(browser, tmp_path):
    """`--set failover_view=models`: the model request and its attempts are listed, the other calls
    to the same host (usage, plugins, analytics) are not (docs/mitmweb.md)."""
    from harness import request

    fake = FakeUpstreamProcess(tmp_path)
    try:
        text, env = pool_yaml(fake.base, [("spare", SPARE_KEY)])
        web = MitmwebProcess(tmp_path, text, env, extra=["--set", "failover_view=models"])
        try:
            for path in ("/backend-api/wham/usage", "/v1/models", "/backend-api/plugins/list"):
                request(web.port, "GET", f"{fake.base}{path}", {"authorization": f"Bearer {CLIENT_KEY}"})
            reply = post_responses(web.port, f"{fake.base}/v1/responses", CLIENT_KEY)
            assert reply.status == 200, reply.body[-500:]
            flows = web.api("/flows")
            assert [f["request"]["path"] for f in flows] == ["/v1/responses"] * 3, [f["request"]["path"] for f in flows]
            assert "failover_view=models" in web.log()
            context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            try:
                page.goto(web.url)
                expect(rows(page)).to_have_count(3)
                expect(row_marked(page, REJECTED)).to_have_count(1)
                expect(row_marked(page, SERVED)).to_have_count(1)
            finally:
                context.close()
            # failover_view=all takes the addon's filter back: every flow is listed again.
            web.put("/options", {"failover_view": "all"})
            wait_until(lambda: len(web.api("/flows")) == 6, 5, "every flow listed again")
        finally:
            web.stop()
    finally:
        fake.stop()
