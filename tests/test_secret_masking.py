"""No secret in a log, in an answer to a client or in a config error (core/mask.py, mitm/secret_guard.py,
yaml_file.py, config.py). Pure tables, and the log record factory on a plain logger."""

from __future__ import annotations

import json
import logging

import pytest
from mitmproxy import http

from codex_failover.bounded_decode import Outcome
from codex_failover.config import ConfigError, load_pool
from codex_failover.core.mask import MASK, Secrets, header_secrets
from codex_failover.core.routes import looks_like_key
from codex_failover.core.rules import RulesError
from codex_failover.mitm import client_answers, secret_guard
from codex_failover.rules_file import load_rules

KEY = "sk-proj-" + "Ab3dE5gH7jK9mN1pQ3sT"
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJlLXBhcnQ"
OPAQUE = "gw_" + "7f3a9c2e4b1d8f6a"  # a gateway's own token: no shape, known only as armed

MASK_ROWS = [
    ("sk-key", f"Incorrect API key provided: {KEY}.", f"Incorrect API key provided: {MASK}."),
    ("sk-key-in-bytes-repr", f"b'authorization: Bearer {KEY}\\r\\n'", f"b'authorization: Bearer {MASK}\\r\\n'"),
    ("session-key", "sess-AbCdEfGh12345678 here", f"{MASK} here"),
    ("jwt", f"token {JWT} end", f"token {MASK} end"),
    ("bearer-anything", "Authorization: Bearer abc.def-123_456", f"Authorization: Bearer {MASK}"),
    ("known-opaque", f"x-api-key: {OPAQUE}", f"x-api-key: {MASK}"),
    ("known-inside-json", json.dumps({"k": OPAQUE}), json.dumps({"k": MASK})),
    ("ordinary-text", "attempt 1/3 credential=spare verdict=failover reason=overloaded status=200",
     "attempt 1/3 credential=spare verdict=failover reason=overloaded status=200"),
    ("task-words-stay", "the ask-for-help desk-top task", "the ask-for-help desk-top task"),
    ("short-sk-stays", "sk-abc", "sk-abc"),
]


@pytest.mark.parametrize("name,text,masked", MASK_ROWS, ids=[r[0] for r in MASK_ROWS])
def test_mask(name, text, masked):
    secrets = Secrets()
    secrets.set_pool([OPAQUE])
    assert secrets.mask(text) == masked


def test_armed_values_are_kept_bounded_and_the_pool_replaced_whole():
    secrets = Secrets(recent=2)
    secrets.add(["first-armed-value", "second-armed", "third-armed"])
    assert secrets.known() == {"second-armed", "third-armed"}
    secrets.set_pool(["pooled-value-1"])
    secrets.set_pool(["pooled-value-2", "tiny"])  # under MIN_KNOWN: never a literal mask
    assert secrets.mask("pooled-value-1 pooled-value-2 tiny third-armed") == f"pooled-value-1 {MASK} tiny {MASK}"


def test_the_longer_of_two_overlapping_values_is_masked_whole():
    secrets = Secrets()
    secrets.add(["abcdef", "abcdefghij"])
    assert secrets.mask("abcdefghij") == MASK


def test_mask_in_walks_an_error_object():
    secrets = Secrets()
    error = {"message": f"bad key {KEY}", "attempts": [{"detail": JWT, "status": 401}], "n": 3}
    assert secrets.mask_in(error) == {"message": f"bad key {MASK}", "attempts": [{"detail": MASK, "status": 401}], "n": 3}


@pytest.mark.parametrize("value,parts", [(f"Bearer {KEY}", [f"Bearer {KEY}", KEY]), ("Basic dXNlcjpwdw==",
                                         ["Basic dXNlcjpwdw==", "dXNlcjpwdw=="]), ("acct-123", ["acct-123"])])
def test_header_secrets(value, parts):
    assert header_secrets(value) == parts


KEYLIKE = [
    ("sk-proj-abcdefgh12345678", True),
    ("sk-abc", True),  # any sk- prefix: no name starts so
    ("sess-abcdef", True),
    ("eyJhbGciOiJIUzI1NiJ9abc", True),
    ("a8F3kLm29QzX7pRt5VwYb", True),  # 21 mixed characters, high entropy
    ("0123456789abcdef0123456789abcdef01", True),  # a long hex run
    ("work", False),
    ("personal-2", False),
    ("team.backup_EU-west-1", False),
    ("AcmeCorp-Production2", False),
    ("MyVeryLongCredentialName2024", False),  # camel case and a year: few changes of class
    ("x9Kp2Lq7Wm4Zt8Rv3Yn6", True),
]


@pytest.mark.parametrize("name,keylike", KEYLIKE, ids=[k[0] for k in KEYLIKE])
def test_looks_like_key(name, keylike):
    assert looks_like_key(name) is keylike


@pytest.mark.parametrize("name", ["sk-proj-abcdefgh12345678", "a8F3kLm29QzX7pRt5VwYb", "eyJhbGciOiJIUzI1NiJ9abc"])
def test_a_credential_named_like_a_key_is_refused_in_one_line(tmp_path, name):
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"credentials:\n  - name: {name}\n    api_key_env: K\n")
    with pytest.raises(ConfigError) as info:
        load_pool(pool, {"K": "sk-test-key"})
    message = str(info.value)
    assert name not in message and "\n" not in message
    assert "credentials[0].name: looks like a key or token, not a name (not shown)" in message


TOKEN_YAML = [
    ("undefined-alias", f"credentials: *{KEY}\n"),
    ("unknown-tag", f"credentials: !{KEY} x\n"),
    ("unknown-secondary-tag", f"credentials: !!{KEY} x\n"),
    ("alias-in-a-list", f"credentials:\n  - name: a\n    api_key_env: *{KEY}\n"),
]


@pytest.mark.parametrize("name,text", TOKEN_YAML, ids=[t[0] for t in TOKEN_YAML])
def test_yaml_errors_never_quote_the_token_after_a_star_or_bang(tmp_path, name, text):
    pool = tmp_path / "pool.yaml"
    pool.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_pool(pool, {})
    assert KEY not in str(info.value) and KEY[3:] not in str(info.value)
    assert "not valid YAML at line" in str(info.value) and "(not shown)" in str(info.value)
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    with pytest.raises(RulesError) as info:
        load_rules(rules)
    assert KEY not in str(info.value)


def test_a_short_quoted_character_is_still_named(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("credentials:\t[]\n")
    with pytest.raises(ConfigError) as info:
        load_pool(pool, {})
    assert "'\\t'" in str(info.value)


# -- logs ------------------------------------------------------------------------------------------

@pytest.fixture
def guarded():
    secret_guard.install()
    secret_guard.install()  # twice (a script reload): still one factory
    secret_guard.SECRETS.clear()
    yield secret_guard.SECRETS
    secret_guard.SECRETS.clear()
    secret_guard.uninstall()


def test_every_record_is_masked_whatever_its_logger_or_handler(guarded, caplog):
    guarded.add([OPAQUE])
    caplog.set_level(logging.DEBUG)
    logging.getLogger("mitmproxy.proxy.server").debug("<< SendData(b'x-api-key: %s\\r\\n')", OPAQUE)
    logging.getLogger("elsewhere").warning("client key %s", KEY)
    try:
        raise ValueError(f"boom {OPAQUE}")
    except ValueError:
        logging.getLogger("x").exception("failed")
    text = caplog.text
    assert OPAQUE not in text and KEY not in text
    assert f"x-api-key: {MASK}" in text and f"client key {MASK}" in text and "ValueError: boom" in text
    assert logging.getLogRecordFactory()._codex_failover_base.__name__ != "factory"


def test_set_pool_knows_every_credential_header_and_route_password(guarded, tmp_path):
    pool_file = tmp_path / "pool.yaml"
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": {"access_token": JWT, "account_id": "acct-7f3a9c2e"}}))
    pool_file.write_text(f"routes:\n  corp: ['http://user:{OPAQUE}@127.0.0.1:3128']\ncredentials:\n"
                         f"  - name: a\n    auth_file: {auth}\n    route: corp\n  - name: b\n    api_key_env: K\n")
    secret_guard.set_pool(load_pool(pool_file, {"K": "gw-key-plain-value"}))
    known = guarded.known()
    assert {JWT, "acct-7f3a9c2e", OPAQUE, "gw-key-plain-value", "Bearer gw-key-plain-value"} <= known
    import base64
    assert base64.b64encode(f"user:{OPAQUE}".encode()).decode() in known


# -- answers to the client ------------------------------------------------------------------------

def test_the_exhausted_answer_masks_an_echoed_pooled_key(guarded):
    from codex_failover.core.outcomes import Rejection

    guarded.set_pool([OPAQUE])
    last = Rejection("auth_rejected", 401, {"message": f"Incorrect API key provided: {KEY} ({OPAQUE})"})
    # the last rejection decides; an earlier real one keeps its text
    history = [type("H", (), {"reason": "overloaded", "as_dict": lambda self: {"reason": "overloaded"}})()]
    body = client_answers.exhausted(last, history, None).content.decode()
    assert KEY not in body and OPAQUE not in body
    assert f"Incorrect API key provided: {MASK} ({MASK})" in body


def _answer(status: int, body: bytes, encoding: str | None = None) -> http.Response:
    headers = {"content-type": "application/json"}
    resp = http.Response.make(status, b"", headers)
    if encoding:
        resp.headers["content-encoding"] = encoding
    resp.content = body
    return resp


@pytest.mark.parametrize("own,status,masked", [(False, 400, True), (False, 404, True), (True, 400, False),
                                               (False, 200, False)])
def test_a_pooled_credentials_error_body_is_masked_before_it_is_forwarded(guarded, own, status, masked):
    text = json.dumps({"error": {"message": f"bad request for key {KEY}"}}).encode()
    resp = _answer(status, text, "gzip")
    got = secret_guard.forwarded(resp, Outcome(text), own)
    assert (KEY.encode() not in (got.get_content() or b"")) is masked
    assert got.status_code == status


def test_a_pooled_error_over_the_cap_is_not_forwarded_unread(guarded):
    resp = _answer(400, b"x" * 100, "gzip")
    got = secret_guard.forwarded(resp, Outcome(None, over=True), own=False)
    assert got.status_code == 400 and json.loads(got.content)["error"]["code"] == "upstream_body_too_large"
    ok = _answer(200, b"x" * 100, "gzip")
    assert secret_guard.forwarded(ok, Outcome(None, over=True), own=False).raw_content == ok.raw_content


def test_a_gated_websockets_exhausted_frame_masks_an_echoed_key(guarded):
    from codex_failover.core.outcomes import Rejection
    from codex_failover.ws.dial import as_frames

    (frame, is_text), = as_frames(Rejection("auth_rejected", 401, {"message": f"Incorrect API key provided: {KEY}"}))
    assert is_text and KEY.encode() not in frame
    assert json.loads(frame)["error"]["message"] == f"Incorrect API key provided: {MASK}"


def test_the_secrets_follow_the_pool_object_in_force():
    secrets, pools = Secrets(), [["first-pool-secret"]]
    secrets.follow(lambda: pools[-1], list)
    assert secrets.mask("first-pool-secret") == MASK
    pools.append(["second-pool-secret"])  # a new pool object (a reload, a changed auth file)
    assert secrets.mask("first-pool-secret second-pool-secret") == f"first-pool-secret {MASK}"


def test_a_chatgpt_account_id_header_is_masked_in_any_form():
    from codex_failover.core.mask import MASK, Secrets

    secrets = Secrets()
    for text in ("b'chatgpt-account-id: acct-own-1\\r\\nx'", "{'ChatGPT-Account-ID': 'acct-own-1'}",
                 '{"chatgpt-account-id":"acct-own-1"}', "CHATGPT-ACCOUNT-ID=acct-own-1"):
        masked = secrets.mask(text)
        assert "acct-own-1" not in masked and MASK in masked, masked
