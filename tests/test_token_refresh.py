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
from codex_failover.bounded_file import read_auth_file
from codex_failover.core import token_refresh as tr
from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial, auth_from_document, parse_time

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


def test_a_401_forces_one_refresh_per_login_and_its_fresh_token_refused_again_stays_out():
    book, auth = tr.Refreshes(), material()
    assert book.due(auth, NOW) is None
    assert book.due(auth, NOW, after_401=True) == tr.AFTER_401
    book.start(auth, tr.AFTER_401)
    assert book.transient(auth, NOW) == tr.RETRY_FIRST  # the forced refresh failed for a while: retried, not refused
    assert book.due(auth, NOW + tr.RETRY_FIRST - 1, after_401=True) is None
    assert book.due(auth, NOW + tr.RETRY_FIRST, after_401=True) == tr.AFTER_401
    book.start(auth, tr.AFTER_401)
    new = material(token="t2")
    book.done(auth, new)
    # Upstream refuses the token the forced refresh gave too: no second refresh (no loop against the
    # endpoint, one refresh per request before): the caller takes the credential out, once.
    assert book.due(new, NOW, after_401=True) == tr.REFUSED_AGAIN
    book.permanent(new)
    assert book.state(auth.account) == tr.REFUSED
    assert book.due(new, NOW + DAY, after_401=True) is None
    assert book.due(new, NOW + 30 * DAY) is None
    relogged = material(token="codex-login-anew")  # a new login: a 401 earns one forced refresh again
    assert book.due(relogged, NOW, after_401=True) == tr.AFTER_401


def test_a_refresh_after_the_forced_one_starts_a_new_episode():
    book, auth = tr.Refreshes(), material()
    book.start(auth, tr.AFTER_401)
    fresh = material(token="t2", last=NOW - 9 * DAY)
    book.done(auth, fresh)
    assert book.due(fresh, NOW) == tr.STALE  # its proactive refresh, days later
    book.start(fresh, tr.STALE)
    later = material(token="t3", last=NOW)
    book.done(fresh, later)
    assert book.due(later, NOW, after_401=True) == tr.AFTER_401


def test_found_refreshed_in_the_file_after_a_401_counts_as_the_forced_refresh():
    book, auth = tr.Refreshes(), material()
    book.start(auth, tr.AFTER_401)
    theirs = material(token="written-by-codex")
    book.done(auth, theirs)  # (adopted from the file)
    assert book.due(theirs, NOW, after_401=True) == tr.REFUSED_AGAIN


def test_an_unanswered_exchange_earns_one_more_try_after_refresh_token_reused():
    book, auth = tr.Refreshes(), material(last=None)
    book.start(auth, tr.STALE)
    assert book.reused(auth) is None  # an answered exchange's refresh_token_reused: refused (after the file)
    book.permanent(auth)
    assert book.state(auth.account) == tr.REFUSED

    book, auth = tr.Refreshes(), material(last=None)
    book.start(auth, tr.STALE)
    assert book.unanswered(auth, NOW) == tr.RETRY_FIRST  # the endpoint may have rotated: wait, then file first
    assert book.state(auth.account) == tr.UNANSWERED
    assert book.due(auth, NOW + tr.RETRY_FIRST - 1) is None
    assert book.due(auth, NOW + tr.RETRY_FIRST) == tr.STALE
    book.start(auth, tr.STALE)
    assert book.state(auth.account) == tr.CHECKING
    assert book.reused(auth) == tr.REUSED_WAIT  # once more, after a short wait
    assert book.state(auth.account) == tr.RETRYING
    assert book.due(auth, NOW + DAY) is None  # still in flight
    assert book.reused(auth) is None  # reused again: refused
    book.permanent(auth)
    assert book.state(auth.account) == tr.REFUSED


def test_the_answer_timeout_is_generous_and_the_claim_outlasts_a_retried_exchange():
    assert tr.ANSWER_TIMEOUT >= 30
    assert tr.CLAIM_TTL > 2 * tr.ANSWER_TIMEOUT + tr.REUSED_WAIT


def test_every_transition_is_in_the_table():
    states = {tr.IDLE, tr.REFRESHING, tr.WAITING, tr.REFUSED, tr.UNANSWERED, tr.CHECKING, tr.RETRYING}
    assert {s for s, _ in tr.TRANSITIONS} <= states and set(tr.TRANSITIONS.values()) <= states
    with pytest.raises(KeyError):
        tr.Refreshes()._go(tr._Account(tr.REFUSED), tr.START)  # a failed account never starts by itself
    with pytest.raises(KeyError):
        tr.Refreshes()._go(tr._Account(tr.REFRESHING), tr.REUSED_EVENT)  # one more try only after no answer


SNAP = (7, 1000, 300, "rt-1", "acct")


@pytest.mark.parametrize("name,now,ok", [
    ("the same file", SNAP, True),
    ("removed (codex logout)", None, False),
    ("rewritten in place", (7, 2000, 300, "rt-1", "acct"), False),
    ("replaced (a new inode)", (8, 1000, 300, "rt-1", "acct"), False),
    ("another login of the same account", (7, 1000, 300, "rt-9", "acct"), False),
    ("another account", (7, 1000, 300, "rt-1", "acct-other"), False),
])
def test_a_refresh_writes_back_only_over_the_file_it_read(name, now, ok):
    assert tr.still_the_one(SNAP, now) is ok


@pytest.mark.parametrize("name,now,same", [
    ("rewritten with the same login", (9, 2000, 301, "rt-1", "acct"), True),
    ("removed", None, False),
    ("another login of the same account", (7, 1000, 300, "rt-9", "acct"), False),
    ("another account", (7, 1000, 300, "rt-1", "acct-other"), False),
])
def test_a_file_rewritten_with_the_same_login_still_takes_the_new_tokens(name, now, same):
    assert tr.same_login(SNAP, now) is same
    assert not tr.same_login((7, 1, 1, "", ""), (8, 1, 1, "", ""))  # no refresh token: nothing to keep


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


def seeded(tmp_path, name="auth.json"):
    path = tmp_path / name
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    path.write_text(json.dumps(doc, indent=2))
    os.chmod(path, 0o600)
    return path, doc


def test_write_doc_drops_the_refresh_when_codex_logout_removed_the_file(tmp_path):
    path, doc = seeded(tmp_path)
    read, snap = auth_refresh.read_snapshot(str(path))
    path.unlink()  # `codex logout` while the exchange was under way (Codex takes no lock)
    with pytest.raises(auth_refresh.Changed):
        auth_refresh.write_doc(str(path), tr.merge(read, {"refresh_token": "rt-new"}, NOW), snap)
    assert list(tmp_path.iterdir()) == []  # not re-created, no temporary file left


def test_write_doc_drops_the_refresh_when_a_new_codex_login_wrote_the_file(tmp_path):
    path, doc = seeded(tmp_path)
    read, snap = auth_refresh.read_snapshot(str(path))
    other = {**doc, "tokens": {**doc["tokens"], "refresh_token": "rt-other-login", "account_id": "acct-other"}}
    path.write_text(json.dumps(other, indent=2))  # `codex login` of another account
    with pytest.raises(auth_refresh.Changed):
        auth_refresh.write_doc(str(path), tr.merge(read, {"refresh_token": "rt-new"}, NOW), snap)
    assert json.loads(path.read_text()) == other
    auth_refresh.write_doc(str(path), tr.merge(read, {"refresh_token": "rt-new"}, NOW),
                           auth_refresh.read_snapshot(str(path))[1])  # the file as it is now: written
    assert json.loads(path.read_text())["tokens"]["refresh_token"] == "rt-new"


def test_a_symlinked_auth_json_is_written_through_the_link(tmp_path):
    real_dir, link_dir = tmp_path / "real", tmp_path / "home"
    real_dir.mkdir()
    link_dir.mkdir()
    target, doc = seeded(real_dir)
    os.chmod(target, 0o640)
    link = link_dir / "auth.json"
    link.symlink_to(target)
    read, snap = auth_refresh.read_snapshot(str(link))
    auth_refresh.write_doc(str(link), tr.merge(read, {"refresh_token": "rt-new"}, NOW), snap)
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link kept
    assert json.loads(target.read_text())["tokens"]["refresh_token"] == "rt-new"  # its target holds the new token
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in link_dir.iterdir()) == ["auth.json"]  # the temporary file was beside the target
    assert sorted(p.name for p in real_dir.iterdir()) == ["auth.json"]
    assert auth_refresh.lock_path(str(link)) == f"{target}.lock"  # one lock for every name of the file


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    path, doc = seeded(tmp_path)
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(auth_refresh.os, "fsync", fsync)
    auth_refresh.write_doc(str(path), tr.merge(doc, {"refresh_token": "rt-new"}, NOW))
    assert synced == [False, True]  # the temporary file, then the folder after the rename


class _Reader:
    """A stream whose chunked body claims one huge chunk: what each read asked for is recorded."""

    def __init__(self, data: bytes):
        self.data, self.asked = data, []

    async def readuntil(self, sep):
        i = self.data.index(sep) + len(sep)
        out, self.data = self.data[:i], self.data[i:]
        return out

    async def readexactly(self, n):
        self.asked.append(n)
        if n > len(self.data):
            import asyncio

            raise asyncio.IncompleteReadError(self.data, n)
        out, self.data = self.data[:n], self.data[n:]
        return out


def test_a_chunked_usage_answer_is_read_within_its_bound():
    import asyncio

    from codex_failover.net import usage_fetch

    reader = _Reader(b"%x\r\n" % (400 * 1024 * 1024) + b"x" * (usage_fetch.MAX_BODY + 10))
    body = asyncio.run(usage_fetch._chunked(reader))
    assert len(body) == usage_fetch.MAX_BODY
    assert max(reader.asked) <= usage_fetch.MAX_BODY  # never a 400 MiB read


class _Options:
    def __init__(self, url):
        self.failover_refresh_url = url


@pytest.mark.parametrize("url,error", [
    ("https://auth.openai.com/oauth/token", None),
    ("https://gateway.example/oauth/token", None),
    ("http://127.0.0.1:8080/oauth/token", None),
    ("http://localhost:9/oauth/token", None),
    ("http://[::1]:9/oauth/token", None),
    ("http://auth.example.com/oauth/token", "cleartext"),
    ("http://10.0.0.5/oauth/token", "cleartext"),
    ("ftp://auth.example.com/x", "https URL"),
    ("https://user:pw@auth.example.com/x", "https URL"),
])
def test_the_refresh_url_is_https_or_loopback(url, error):
    from codex_failover.options import parse_options

    if error is None:
        parse_options(_Options(url), {"failover_refresh_url"})
        return
    with pytest.raises(ValueError) as exc:
        parse_options(_Options(url), {"failover_refresh_url"})
    assert error in str(exc.value) and str(exc.value).startswith("failover_refresh_url:") and "\n" not in str(exc.value)


# -- the shell (mitm/token_refresher.py) with the exchange scripted --------------------------------------


class _Owner:
    """What TokenRefresher reads of the addon: the pool, health, a store-less keeper, the auth watch."""

    def __init__(self, cred):
        import types

        from codex_failover.core.health import Health
        from codex_failover.core.policy import PoolConfig

        self.pool = PoolConfig((cred,))
        self.health = Health()
        self.keeper = types.SimpleNamespace(store=None)
        self.files = types.SimpleNamespace(auth=types.SimpleNamespace(wrote=lambda path: None))

    def shared(self):
        import types

        return types.SimpleNamespace(bridges=None, upstream_tls=None)


def _shell(tmp_path, monkeypatch, answers, between=None):
    """A refresher over a pooled login whose token endpoint answers `answers` in turn (an exception:
    raised); `between()` runs during the wait before one more try. (refresher, cred, path, calls, waits)."""
    import asyncio  # noqa: F401

    from codex_failover.core.policy import Credential
    from codex_failover.mitm import token_refresher as shell

    path, doc = seeded(tmp_path)
    doc["last_refresh"] = "2020-01-01T00:00:00Z"  # long past Codex's 8 days
    path.write_text(json.dumps(doc, indent=2))
    cred = Credential("work", auth_from_document(doc, str(path)), "https://x", str(path), auth_file=str(path))
    refresher = shell.TokenRefresher(_Owner(cred))
    refresher._url = lambda: "https://auth.example/oauth/token"
    calls, waits = [], []

    async def post_json(url, body, via, bridges, tls, timeout, answer_timeout=None):
        calls.append((body["refresh_token"], timeout, answer_timeout))
        answer = answers.pop(0)
        if callable(answer):  # something happens to the file while the exchange is under way
            answer = answer()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def sleep(seconds):
        waits.append(seconds)
        if between:
            between()

    monkeypatch.setattr(shell, "post_json", post_json)
    refresher.sleep = sleep
    return refresher, cred, path, calls, waits


def _run(refresher, cred, reason=tr.STALE):
    import asyncio

    refresher.book.start(refresher.owner.pool.credentials[0].auth, reason)
    asyncio.run(refresher.refresh(refresher.owner.pool.credentials[0], reason))


REUSED_401 = (401, {"error": {"code": "refresh_token_reused"}})
CLAIMS = {"https://api.openai.com/auth": {"chatgpt_account_id": "2b1c1a9e-0000-4000-8000-000000000001",
                                          "chatgpt_user_id": "user-12345"}}  # the example login's
NEW_TOKENS = (200, {"access_token": jwt({**CLAIMS, "exp": NOW + 10 * DAY, "n": 2}), "refresh_token": "rt-after-retry"})


def test_an_exchange_without_an_answer_does_not_burn_the_login(tmp_path, monkeypatch, caplog):
    """The endpoint rotated the token but its answer came too late: the next try reads the file,
    gets refresh_token_reused, reads the file again and tries once more after a short wait."""
    from codex_failover.net.usage_fetch import NoAnswer

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [NoAnswer("no answer within 30s"),
                                                                         REUSED_401, NEW_TOKENS])
    sent = json.loads(path.read_text())["tokens"]["refresh_token"]
    _run(refresher, cred)
    assert refresher.book.state(cred.auth.account) == tr.UNANSWERED
    assert "token refresh got no answer (no answer within 30s); the endpoint may have used the refresh token" in caplog.text
    assert calls == [(sent, cred_policy_timeout(refresher), tr.ANSWER_TIMEOUT)]  # its own, generous answer timeout
    _run(refresher, cred)
    assert [c[0] for c in calls] == [sent, sent, sent] and waits == [tr.REUSED_WAIT]
    assert json.loads(path.read_text())["tokens"]["refresh_token"] == "rt-after-retry"
    assert refresher.owner.health.state("work").status != "out"
    assert "refresh_token_reused after an exchange that got no answer; auth.json unchanged: one more try" in caplog.text


def cred_policy_timeout(refresher):
    return refresher.owner.pool.policy.connect_timeout


def test_refresh_token_reused_twice_after_no_answer_is_refused_with_one_line(tmp_path, monkeypatch, caplog):
    from codex_failover.net.usage_fetch import NoAnswer

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [NoAnswer("x"), REUSED_401, REUSED_401])
    _run(refresher, cred)
    _run(refresher, cred)
    assert len(calls) == 3 and waits == [tr.REUSED_WAIT]  # one more try, not a loop
    assert refresher.book.state(cred.auth.account) == tr.REFUSED
    assert refresher.owner.health.state("work").status == "out"
    assert caplog.text.count("token refresh refused (refresh_token_reused); out of rotation until you log in") == 1


def test_refresh_token_reused_after_an_answered_exchange_is_refused_at_once(tmp_path, monkeypatch, caplog):
    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [REUSED_401])
    _run(refresher, cred)
    assert len(calls) == 1 and waits == []
    assert refresher.owner.health.state("work").status == "out"


def test_someone_elses_refresh_found_during_the_wait_is_adopted(tmp_path, monkeypatch, caplog):
    from codex_failover.net.usage_fetch import NoAnswer

    def codex_refreshes():
        doc = json.loads(path.read_text())
        doc["tokens"] = {**doc["tokens"], "access_token": jwt({**CLAIMS, "exp": NOW + 10 * DAY, "n": 9}),
                         "refresh_token": "rt-by-codex"}
        path.write_text(json.dumps(doc, indent=2))

    caplog.set_level("INFO", "codex_failover")
    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [NoAnswer("x"), REUSED_401],
                                                 between=codex_refreshes)
    _run(refresher, cred)
    _run(refresher, cred)
    assert len(calls) == 2 and waits == [tr.REUSED_WAIT]
    assert json.loads(path.read_text())["tokens"]["refresh_token"] == "rt-by-codex"
    assert "refreshed by another program (refresh_token_reused" in caplog.text
    assert refresher.owner.health.state("work").status != "out"


def test_a_refresh_token_missing_on_reread_takes_the_credential_out_with_one_line(tmp_path, monkeypatch, caplog):
    from codex_failover.core.token_expiry import login_command

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [])
    doc = json.loads(path.read_text())
    del doc["tokens"]["refresh_token"]  # (same access token: not someone else's refresh)
    path.write_text(json.dumps(doc, indent=2))
    _run(refresher, cred)
    assert calls == []
    lines = [r.getMessage() for r in caplog.records if "credential work" in r.getMessage()]
    assert lines == [f"codex-failover: credential work: {path} holds no refresh_token; out of rotation until you "
                     f"log in again: {login_command(str(path))}"]
    assert refresher.owner.health.state("work").status == "out"
    assert refresher.book.state(cred.auth.account) == tr.REFUSED


def test_a_401_on_the_freshly_refreshed_token_is_one_line_and_no_second_refresh(tmp_path, monkeypatch, caplog):
    import asyncio

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [NEW_TOKENS])
    monkeypatch.setattr(refresher, "_enabled", lambda: True)
    health = refresher.owner.health
    health.take_out("work", "HTTP 401 from upstream; run `codex login` for this account")

    async def look():
        refresher.check(force=True)
        await asyncio.gather(*refresher.tasks.values())

    asyncio.run(look())
    assert len(calls) == 1 and health.state("work").status != "out"  # forced refresh, back in rotation
    for _ in range(3):  # its new token refused too, request after request
        health.take_out("work", "HTTP 401 from upstream; run `codex login` for this account")
        asyncio.run(look())
    assert len(calls) == 1  # no loop against the token endpoint
    assert health.state("work").status == "out"
    assert caplog.text.count("upstream answered 401 to its freshly refreshed token too; out of rotation until you "
                             "log in again") == 1


@pytest.mark.parametrize("behaviour,words", [("silent", "no answer within 0.3s"),
                                             ("closes", "the connection closed before the answer")])
def test_a_sent_exchange_without_a_whole_answer_is_no_answer_bounded_by_its_own_timeout(behaviour, words):
    """The refresh's answer has its own timeout, apart from connecting; its end says the request
    was sent (the endpoint may have acted on it)."""
    import asyncio

    from codex_failover.net import usage_fetch

    async def main():
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            if behaviour == "closes":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
                await writer.drain()
                writer.close()
                return
            await asyncio.sleep(5)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(usage_fetch.NoAnswer) as exc:
                await asyncio.wait_for(usage_fetch.post_json(f"http://127.0.0.1:{port}/oauth/token", {"a": 1}, None,
                                                             None, None, 5.0, 0.3), 3)
            assert words in str(exc.value)
        finally:
            server.close()

    asyncio.run(main())


def test_a_file_rewritten_with_the_same_login_during_the_exchange_gets_the_new_tokens(tmp_path, monkeypatch, caplog):
    """Only the login decides: a file rewritten as it was (an editor, a copy back) still gets the
    rotated tokens, merged into it as it is now (the refresh token sent is spent: leaving it would
    lose the login)."""

    def rewrite():
        doc = json.loads(path.read_text())
        path.unlink()
        path.write_text(json.dumps({**doc, "note": "kept"}))  # another inode, size and format
        return NEW_TOKENS

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [rewrite])
    _run(refresher, cred)
    after = json.loads(path.read_text())
    assert after["tokens"]["refresh_token"] == "rt-after-retry" and after["note"] == "kept"
    assert "changed while its token refresh" not in caplog.text


def test_codex_logout_during_the_exchange_is_not_undone(tmp_path, monkeypatch, caplog):
    def logout():
        path.unlink()
        return NEW_TOKENS

    refresher, cred, path, calls, waits = _shell(tmp_path, monkeypatch, [logout])
    _run(refresher, cred)
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["auth.json.lock"]
    assert caplog.text.count("changed while its token refresh was under way") == 1
    assert refresher.owner.pool.credentials[0].auth == cred.auth  # the refreshed tokens dropped
