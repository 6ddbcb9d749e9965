"""ChatGPT spares' token ends, said ahead of time (core/token_expiry.py): at start-up one line per
spare with the command that refreshes it, a warning under 24 h, the same facts on the status page."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import ProxyProcess

from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.token_expiry import ExpiryWatch, describe, line, refresh_command

NOW = 1_800_000_000.0


def cred(name="work", exp=NOW + 3 * 86400, kind=CHATGPT, auth_file="~/.codex-work/auth.json"):
    auth = AuthMaterial(kind, "secret-token", "acct", expires_at=exp)
    return SimpleNamespace(name=name, auth=auth, kind=kind, auth_file=str(Path(auth_file).expanduser()) if auth_file else None)


def test_the_refresh_command_names_the_folder_of_its_auth_json():
    assert refresh_command(cred()) == "CODEX_HOME=~/.codex-work codex login"
    assert refresh_command(cred(auth_file="/srv/my accounts/b/auth.json")) == "CODEX_HOME='/srv/my accounts/b' codex login"
    assert refresh_command(cred(auth_file=None)) == "codex login (for that account)"


def test_lines_say_when_and_warn_under_a_day():
    warn, text = line(cred(exp=NOW + 3 * 86400), NOW)
    assert not warn and "ChatGPT access token expires at" in text and "in 3.0 days" in text
    assert "CODEX_HOME=~/.codex-work codex login" in text
    warn, text = line(cred(exp=NOW + 5 * 3600), NOW)
    assert warn and "in 5.0 h; refresh it now: CODEX_HOME=~/.codex-work codex login" in text
    warn, text = line(cred(exp=NOW - 60), NOW)
    assert warn and "expired at" in text and "skipped until refreshed" in text
    assert line(cred(kind=APIKEY, exp=None), NOW) is None
    assert "secret-token" not in text


def test_a_token_coming_within_a_day_while_running_is_warned_once():
    watch, c = ExpiryWatch(), cred(exp=NOW + 2 * 86400)
    assert [w for w, _ in watch.at_start([c], NOW)] == [False]
    assert watch.check([c], NOW + 3600) == []
    later = NOW + 86400 + 60  # under 24 h left now
    (text,) = watch.check([c], later)
    assert "refresh it now" in text
    assert watch.check([c], later + 60) == []  # once
    fresh = cred(exp=NOW + 5 * 86400)  # codex login again: a new token, a new end
    assert watch.check([fresh], later) == []


def test_status_fields():
    assert describe(cred(exp=NOW + 7200), NOW)["token_expires_in_s"] == 7200
    assert describe(cred(exp=NOW + 7200), NOW)["refresh"] == "CODEX_HOME=~/.codex-work codex login"
    assert describe(cred(kind=APIKEY, exp=None), NOW) is None


def jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


@pytest.mark.e2e
def test_start_up_log_and_status_page_say_when_each_spare_expires(tmp_path):
    ends = {"soon": time.time() + 5 * 3600, "later": time.time() + 6 * 86400}
    lines = ["credentials:"]
    for name, exp in ends.items():
        folder = tmp_path / f".codex-{name}"
        folder.mkdir()
        (folder / "auth.json").write_text(json.dumps({"tokens": {"access_token": jwt({"exp": exp}),
                                                                 "account_id": f"acct-{name}"}}))
        lines += [f"  - name: {name}", f"    auth_file: {folder / 'auth.json'}"]
    proxy = ProxyProcess(tmp_path, "\n".join(lines) + "\n")
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy.port}"}))
        report = json.loads(opener.open("http://codex-failover.status/", timeout=10).read())
    finally:
        proxy.stop()
    log = proxy.log()
    soon = next(line for line in log.splitlines() if "credential soon:" in line)
    assert f"refresh it now: CODEX_HOME={tmp_path / '.codex-soon'} codex login" in soon
    later = next(line for line in log.splitlines() if "credential later:" in line)
    assert "in 6.0 days" in later and f"CODEX_HOME={tmp_path / '.codex-later'} codex login" in later
    by_name = {c["name"]: c for c in report["credentials"]}
    assert 5 * 3600 - 60 < by_name["soon"]["token_expires_in_s"] <= 5 * 3600
    assert by_name["later"]["refresh"] == f"CODEX_HOME={tmp_path / '.codex-later'} codex login"
    assert "eyJ" not in log


def test_failover_status_prints_the_token_end_and_its_command():
    from codex_failover.core import status

    entry = {"name": "work", "kind": CHATGPT, "base_url": "https://chatgpt.com/backend-api/codex", "state": "ready",
             "reason": None, "usage": "no usage seen", **describe(cred(exp=NOW + 5 * 3600), NOW)}
    report = {"pool": "/x/pool.yaml", "credentials": [entry], "clients": [], "routes": [], "websockets": [],
              "held_requests": 0, "attempts_in_flight": 0, "relay_streaming": 0, "relay_unclaimed": 0}
    text = status.render(report)
    assert "token expires in 5.0 h (CODEX_HOME=~/.codex-work codex login)" in text
