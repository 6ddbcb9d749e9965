"""When a pooled ChatGPT login is refreshed and what the token endpoint's answer means
(core/token_refresh.py), on a clock; and the auth.json written back (auth_refresh.py)."""

import base64
import json
import os
import stat
import threading

import pytest
from conftest import WIRE

from codex_failover import auth_refresh
from codex_failover.core import token_refresh as tr
from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial, auth_from_document, parse_time, read_auth_file

NOW = 1_800_000_000.0
DAY = 86400.0


def jwt(claims):
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


def material(token="t1", exp=NOW + 5 * DAY, last=NOW - DAY, refreshable=True, kind=CHATGPT, user="u1"):
    access = jwt({"exp": exp, "https://api.openai.com/auth": {"chatgpt_user_id": user}, "t": token})
    return AuthMaterial(kind, access, account_id="acct" if kind == CHATGPT else None, expires_at=exp,
                        last_refresh=last, refreshable=refreshable)


@pytest.mark.parametrize("name,auth,reason", [
    ("fresh", material(), None),
    ("past Codex's 8 days", material(last=NOW - 8 * DAY - 1), tr.STALE),
    ("never refreshed (no last_refresh)", material(last=None), tr.STALE),
    ("ends within a day", material(exp=NOW + 3600), tr.EXPIRING),
    ("ends within a day, refreshed minutes ago", material(exp=NOW + 3600, last=NOW - 600), None),
    ("expired", material(exp=NOW - 1), tr.EXPIRED),
    ("no refresh token", material(last=NOW - 9 * DAY, refreshable=False), None),
    ("an API key", material(kind=APIKEY, last=None), None),
])
def test_when_a_refresh_is_due(name, auth, reason):
    assert tr.Refreshes().due(auth, NOW) == reason


def test_single_flight_backoff_and_permanent_failure_until_a_new_login():
    book, auth = tr.Refreshes(), material(last=None)
    assert book.due(auth, NOW) == tr.STALE
    book.start(auth, tr.STALE)
    assert book.state(auth.account) == tr.REFRESHING
    assert book.due(auth, NOW) is None  # one refresh per account at a time
    assert book.due(material(last=None, token="other"), NOW) is None  # the same account, another token
    assert book.transient(auth, NOW) == tr.RETRY_FIRST
    assert book.due(auth, NOW + tr.RETRY_FIRST - 1) is None
    assert book.due(auth, NOW + tr.RETRY_FIRST) == tr.STALE
    book.start(auth, tr.STALE)
    assert book.transient(auth, NOW) == 2 * tr.RETRY_FIRST  # doubling
    book.start(auth, tr.STALE)
    book.permanent(auth)
    assert book.state(auth.account) == tr.REFUSED
    assert book.due(auth, NOW + 30 * DAY) is None  # never again for this token
    assert book.due(auth, NOW, after_401=True) is None
    fresh = material(token="relogged", last=NOW - 9 * DAY)  # `codex login` anew
    assert book.due(fresh, NOW) == tr.STALE
    assert book.state(auth.account) == tr.IDLE


def test_done_and_a_refresh_elsewhere():
    book, auth, new = tr.Refreshes(), material(last=None), material(token="t2", last=NOW)
    book.start(auth, tr.STALE)
    book.done(auth, new)
    assert book.state(auth.account) == tr.IDLE and book.due(new, NOW) is None
    soon = material(token="t2", exp=NOW + 3000, last=NOW - 2 * 3600)
    assert book.due(soon, NOW) == tr.EXPIRING
    book.start(soon, tr.EXPIRING)
    book.elsewhere(soon, NOW)  # another proxy's claim: look again after CLAIM_TTL, not a failure
    assert book.due(soon, NOW + tr.CLAIM_TTL - 1) is None
    assert book.due(soon, NOW + tr.CLAIM_TTL) == tr.EXPIRING


def test_a_401_forces_one_refresh_per_token():
    book, auth = tr.Refreshes(), material()
    assert book.due(auth, NOW) is None
    assert book.due(auth, NOW, after_401=True) == tr.AFTER_401
    book.start(auth, tr.AFTER_401)
    new = material(token="t2")
    book.done(auth, new)
    assert book.due(new, NOW, after_401=True) == tr.AFTER_401  # a new token: once more
    book.start(new, tr.AFTER_401)
    newer = material(token="t3")
    book.done(new, newer)
    book.start(newer, tr.AFTER_401)
    book.done(newer, newer)  # (found the same token in the file)
    assert book.due(newer, NOW, after_401=True) is None  # refused again after its forced refresh: stays out


def test_every_transition_is_in_the_table():
    states = {tr.IDLE, tr.REFRESHING, tr.WAITING, tr.REFUSED}
    assert {s for s, _ in tr.TRANSITIONS} <= states and set(tr.TRANSITIONS.values()) <= states
    with pytest.raises(KeyError):
        tr.Refreshes()._go(tr._Account(tr.REFUSED), tr.START)  # a failed account never starts by itself


@pytest.mark.parametrize("status,doc,outcome", [
    (200, {"access_token": "a", "refresh_token": "r", "id_token": "i"},
     tr.Refreshed({"access_token": "a", "refresh_token": "r", "id_token": "i"})),
    (200, {"access_token": "a", "extra": "x"}, tr.Refreshed({"access_token": "a"})),
    (200, {}, tr.Transient("an answer without tokens")),
    (200, None, tr.Transient("an answer without tokens")),
    (401, json.loads((WIRE / "auth" / "refresh_response_401_refresh_token_expired.json").read_text()),
     tr.Permanent("refresh_token_expired")),
    (401, json.loads((WIRE / "auth" / "refresh_response_401_refresh_token_invalidated.json").read_text()),
     tr.Permanent("refresh_token_invalidated")),
    (401, json.loads((WIRE / "auth" / "refresh_response_401_refresh_token_reused.json").read_text()), tr.Reused()),
    (400, {"error": "invalid_grant", "error_description": "secret-ish text"}, tr.Permanent("invalid_grant")),
    (401, {"code": "refresh_token_expired"}, tr.Permanent("refresh_token_expired")),
    (401, {"error": {"code": "something new", "message": "never repeated"}}, tr.Permanent("HTTP 401")),
    (503, {"error": "overloaded"}, tr.Transient("HTTP 503")),
    (500, None, tr.Transient("HTTP 500")),
])
def test_what_an_answer_means(status, doc, outcome):
    assert tr.judge(status, doc) == outcome


def test_request_body_is_codexs():
    assert tr.request_doc("rt_fake_refresh_token_value") == json.loads((WIRE / "auth" / "refresh_request.json").read_text())


def test_merge_keeps_the_account_id_and_every_other_field():
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    out = tr.merge(doc, {"access_token": "new-access-token", "refresh_token": "new-refresh-token"}, NOW)
    assert out["tokens"]["account_id"] == doc["tokens"]["account_id"]
    assert out["tokens"]["id_token"] == doc["tokens"]["id_token"]  # not in the answer: kept
    assert out["tokens"]["refresh_token"] == "new-refresh-token"
    assert out["auth_mode"] == "chatgpt" and out["OPENAI_API_KEY"] is None
    assert parse_time(out["last_refresh"]) == pytest.approx(NOW, abs=1e-5)
    assert doc["tokens"]["refresh_token"] == "rt_fake_refresh_token_value"  # the input is untouched
    assert auth_from_document(out, "x").last_refresh == pytest.approx(NOW, abs=1e-5)


def test_codexs_last_refresh_is_read():
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    auth = auth_from_document(doc, "x")
    assert auth.refreshable and auth.last_refresh == pytest.approx(parse_time("2026-09-20T10:15:30.123456Z"))
    assert parse_time("2026-09-20T10:15:30.123456789Z") == pytest.approx(parse_time("2026-09-20T10:15:30.123456Z"))
    assert parse_time("2026-09-20T12:15:30+02:00") == pytest.approx(parse_time("2026-09-20T10:15:30Z"))
    assert parse_time("yesterday") is None and parse_time(None) is None


def test_the_account_survives_a_refresh():
    """A refresh changes the token, never who it is: sessions, usage and reset credits match by it."""
    a, b = material(token="one"), material(token="two")
    assert a.fingerprint != b.fingerprint and a.account == b.account
    assert material(user="someone-else").account != a.account  # another member of the workspace


def test_write_doc_is_atomic_keeps_the_mode_and_codexs_format(tmp_path):
    path = tmp_path / "auth.json"
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o640)
    inode = path.stat().st_ino
    new = tr.merge(doc, {"access_token": jwt({"exp": NOW}), "refresh_token": "rt-2"}, NOW)
    auth_refresh.write_doc(str(path), new)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.stat().st_ino != inode  # renamed over: a reader sees the old file or the new, never half
    assert path.read_text() == json.dumps(new, indent=2)
    assert read_auth_file(path).account_id == doc["tokens"]["account_id"]
    assert [p.name for p in tmp_path.iterdir()] == ["auth.json"]  # no temporary file left


def test_the_lock_keeps_a_second_holder_out(tmp_path):
    path = str(tmp_path / "auth.json")
    fd = auth_refresh.acquire(path)
    try:
        with pytest.raises(TimeoutError):
            auth_refresh.acquire(path, wait=0.1)
        got = []
        t = threading.Thread(target=lambda: got.append(auth_refresh.acquire(path, wait=5)))
        t.start()
    finally:
        auth_refresh.release(fd)
    t.join(5)
    assert got
    auth_refresh.release(got[0])
    assert stat.S_IMODE(os.stat(auth_refresh.lock_path(path)).st_mode) == 0o600


def test_the_clients_own_pooled_login_is_matched_by_account_after_a_refresh():
    """The pool refreshed the login the client also uses: the client's (older or newer) token is
    still its own pooled credential, its own session and its own usage, not another account."""
    from codex_failover.core.affinity import affinity_key
    from codex_failover.core.health import Health
    from codex_failover.core.planner import client_key, make_plan
    from codex_failover.core.policy import Credential, PoolConfig

    pooled, client = material(token="refreshed-by-the-pool"), material(token="codexs-older-one")
    spare = AuthMaterial(CHATGPT, jwt({"other": 1}), account_id="acct-2")
    pool = PoolConfig((Credential("mine", pooled, "https://x", "f"), Credential("spare", spare, "https://x", "g")))
    plan = make_plan(client, pool, Health(lambda: NOW))
    assert [(c.name, c.is_client) for c in plan.candidates] == [("mine", True), ("spare", False)]
    assert affinity_key(client.account, "s1") == affinity_key(pooled.account, "s1")
    assert client_key(client) == client_key(pooled)
