"""The status page at `http://codex-failover.status/`: the dashboard for a browser (a static page of
the package's own, dashboard/, that polls `/view.json`: core/dashboard.py's view model), the JSON
report for scripts (`Accept: application/json`, or any request that does not ask for HTML), and
`POST /reset/NAME` (account_back.py). Who may ask is decided before (the addon's request hook)."""

from __future__ import annotations

import json
import time
from importlib import resources

from mitmproxy import http
from mitmproxy.utils import human

from ..core import dashboard
from .boundary import not_own_user

# The page loads only its own script and style and fetches only its own origin; nothing may frame it.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/favicon.svg": ("favicon.svg", "image/svg+xml"), "/favicon.ico": ("favicon.svg", "image/svg+xml")}
_cache: dict[str, bytes] = {}


def _static(name: str) -> bytes:
    if name not in _cache:
        _cache[name] = resources.files("codex_failover").joinpath("dashboard", name).read_bytes()
    return _cache[name]


def _headers(content_type: str) -> dict[str, str]:
    return {"content-type": content_type, "cache-control": "no-store", "x-content-type-options": "nosniff",
            "content-security-policy": CSP, "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def wants_html(request: http.Request) -> bool:
    """A browser's navigation asks for text/html; curl (`*/*`) and scripts get the JSON."""
    accept = request.headers.get("accept", "")
    return "text/html" in accept and "application/json" not in accept


def respond(addon, flow: http.HTTPFlow) -> http.Response:
    """The status host's answer to one of the user's own programs (other users get a 403); a POST
    ends a cooldown (account_back.py)."""
    if not addon.boundary.is_own(flow.client_conn):
        return not_own_user()
    return addon.back.reset_from_status_page(flow) if flow.request.method == "POST" else answer(addon, flow)


def answer(addon, flow: http.HTTPFlow) -> http.Response:
    """A GET (or HEAD) of the status host, from one of the user's own programs."""
    path = flow.request.path.split("?")[0]
    if path == "/view.json":
        addon.usage_poller.watched()
        view = dashboard.view(addon.status_report(), addon.activity, time.time(), addon.usage_poller.notes)
        reached = flow.client_conn.sockname  # the footer's `curl -x` names the proxy this page came through
        view["proxy"] = human.format_address(reached) if reached else None
        return http.Response.make(200, json.dumps(view).encode(), _headers("application/json"))
    if path == "/" and not wants_html(flow.request):
        report = addon.status_report()
        report["recent"] = dashboard.request_rows(addon.activity.recent)
        return http.Response.make(200, json.dumps(report, indent=2).encode(),
                                  {"content-type": "application/json", "cache-control": "no-store"})
    if path in STATIC:
        name, content_type = STATIC[path]
        return http.Response.make(200, _static(name), _headers(content_type))
    return http.Response.make(404, json.dumps({"error": "GET / is the status (HTML for a browser, JSON otherwise); "
                                                        "GET /view.json is the dashboard's data; "
                                                        "POST /reset/NAME ends credential NAME's cooldown"}).encode(),
                              {"content-type": "application/json"})
