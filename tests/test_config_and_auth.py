"""Pool file loading (all-or-nothing, clear errors, no secrets), auth.json reading."""

import json

import pytest
from conftest import WIRE

from codex_failover.bounded_file import read_auth_file
from codex_failover.config import ConfigError, Policy, load_pool
from codex_failover.core.auth import APIKEY, CHATGPT, AuthError, auth_from_headers
from codex_failover.core.cooldown_policy import OverloadPolicy

AUTH = WIRE / "auth"


def write(tmp_path, text, name="pool.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_no_pool_file_means_client_only():
    pool = load_pool(None)
    assert pool.credentials == ()
    assert pool.policy == Policy()


def test_full_pool(tmp_path):
    path = write(tmp_path, f"""
credentials:
  - name: work
    auth_file: {AUTH / 'auth.chatgpt.example.json'}
  - name: spare-key
    api_key_env: SPARE_OPENAI_KEY
    base_url: https://api.openai.com/v1/
policy:
  max_attempts: 3
  bootstrap_timeout: 20s
  overload_cooldown: 1m
  use_client_credential: false
  max_retry_after: 2s
""")
    pool = load_pool(path, {"SPARE_OPENAI_KEY": "sk-secret-value"})
    work, spare = pool.credentials
    assert (work.name, work.kind, work.base_url) == ("work", CHATGPT, "https://chatgpt.com/backend-api/codex")
    assert work.auth.account_id == "2b1c1a9e-0000-4000-8000-000000000001"
    assert (spare.kind, spare.base_url, spare.source) == (APIKEY, "https://api.openai.com/v1", "$SPARE_OPENAI_KEY")
    assert pool.policy == Policy(max_attempts=3, bootstrap_timeout=20, overload_cooldown=60,
                                 use_client_credential=False, max_retry_after=2,
                                 overload=OverloadPolicy(first=60))  # overload_cooldown: a streak's first rest
    assert "sk-secret-value" not in repr(pool)


def test_example_pool_file_documents_every_policy_field():
    from dataclasses import fields
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "rules" / "pool.example.yaml").read_text()
    for f in fields(Policy):
        assert f"{f.name}:" in text, f"rules/pool.example.yaml does not document policy.{f.name}"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("credentials: {}", "credentials: expected a list"),
        ("bogus: 1", "unknown field(s) bogus"),
        ("credentials:\n  - name: a\n", "credentials[0] (a): give exactly one of auth_file or api_key_env"),
        ("credentials:\n  - name: a b\n    api_key_env: K\n", "credentials[0].name"),
        ("credentials:\n  - name: a\n    api_key_env: MISSING\n", "credentials[0].api_key_env: environment variable MISSING is not set"),
        ("credentials:\n  - {name: a, api_key_env: K}\n  - {name: a, api_key_env: K}\n", "credentials[1].name: duplicate name 'a'"),
        ("credentials:\n  - {name: a, api_key_env: K, base_url: 'ftp://x'}\n", "credentials[0].base_url"),
        ("credentials:\n  - {name: a, api_key_env: K, base_url: 'https://u:p@x/v1'}\n", "credentials in the URL"),
        ("credentials:\n  - {name: a, api_key_env: K, extra: 1}\n", "credentials[0]: unknown field(s) extra"),
        ("policy: {max_attempts: 0}", "policy.max_attempts"),
        ("policy: {bootstrap_timeout: soon}", "policy.bootstrap_timeout: not a duration"),
        ("policy: {use_client_credential: 'yes'}", "policy.use_client_credential: expected true or false"),
        ("policy: {response_timeout: 0}", "policy.response_timeout: must be > 0"),
        ("policy: {nope: 1}", "policy: unknown field(s) nope"),
        ("credentials: [", "not valid YAML"),
    ],
)
def test_broken_pool_files_name_file_field_and_problem(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_pool(path, {"K": "sk-secret-value"})
    message = str(info.value)
    assert str(path) in message
    assert needle in message
    assert "sk-secret-value" not in message


@pytest.mark.parametrize("content,problem", [
    (None, "No such file or directory"),  # removed
    ("", "is empty"),  # emptied
    (json.dumps({"OPENAI_API_KEY": None, "tokens": None, "last_refresh": None}), "logged out"),  # `codex logout`
    ("{broken", "not valid JSON"),
])
def test_unusable_auth_file_is_skipped_not_fatal(tmp_path, content, problem):
    """A credential whose auth.json cannot be used does not stop the start: it is skipped, named,
    and the rest of the pool loads."""
    home = tmp_path / "spare"
    home.mkdir()
    if content is not None:
        (home / "auth.json").write_text(content)
    path = write(tmp_path, f"credentials:\n  - name: spare\n    auth_file: {home}/auth.json\n"
                           "  - name: key\n    api_key_env: K\n")
    pool = load_pool(path, {"K": "sk-secret-value"})
    assert [c.name for c in pool.credentials] == ["key"]
    (skip,) = pool.skipped
    assert (skip.name, skip.auth_file) == ("spare", str(home / "auth.json"))
    assert problem in skip.problem
    line = skip.line(f"CODEX_HOME={home} codex login")
    assert str(home / "auth.json") in line and "codex login" in line


def test_skipped_name_still_counts_for_duplicates(tmp_path):
    path = write(tmp_path, f"credentials:\n  - name: a\n    auth_file: {tmp_path}/none.json\n"
                           "  - name: a\n    api_key_env: K\n")
    with pytest.raises(ConfigError, match="duplicate name 'a'"):
        load_pool(path, {"K": "sk-secret-value"})


def test_auth_file_without_credentials(tmp_path):
    bad = write(tmp_path, json.dumps({"OPENAI_API_KEY": None, "tokens": None}), "auth.json")
    with pytest.raises(AuthError, match="neither tokens.access_token nor OPENAI_API_KEY"):
        read_auth_file(bad)
    notjson = write(tmp_path, "{", "broken.json")
    with pytest.raises(AuthError, match="not valid JSON"):
        read_auth_file(notjson)


def test_read_auth_files():
    chatgpt = read_auth_file(AUTH / "auth.chatgpt.example.json")
    assert chatgpt.kind == CHATGPT
    assert chatgpt.expires_at == 1790864000
    assert chatgpt.headers()["ChatGPT-Account-ID"] == "2b1c1a9e-0000-4000-8000-000000000001"
    key = read_auth_file(AUTH / "auth.apikey.example.json")
    assert key.kind == APIKEY
    assert key.headers() == {"Authorization": "Bearer sk-test-key"}
    assert "sk-test-key" not in repr(key)


def test_account_id_falls_back_to_id_token_claim(tmp_path):
    doc = json.loads((AUTH / "auth.chatgpt.example.json").read_text())
    del doc["tokens"]["account_id"]
    path = write(tmp_path, json.dumps(doc), "auth.json")
    assert read_auth_file(path).account_id == "2b1c1a9e-0000-4000-8000-000000000001"


def test_client_credential_from_headers():
    assert auth_from_headers({"authorization": "Bearer sk-abc"}).kind == APIKEY
    chatgpt = auth_from_headers({"authorization": "Bearer a.b.c", "chatgpt-account-id": "acct"})
    assert chatgpt.kind == CHATGPT
    assert chatgpt.account_id == "acct"
    assert auth_from_headers({}) is None
    assert auth_from_headers({"authorization": "Basic x"}) is None


def test_example_pool_file_loads(tmp_path):
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "rules" / "pool.example.yaml").read_text()
    path = write(tmp_path, text.replace("~/.codex-work/auth.json", str(AUTH / "auth.chatgpt.example.json")))
    pool = load_pool(path, {"SPARE_OPENAI_KEY": "sk-x"})
    assert [c.name for c in pool.credentials] == ["work", "spare-key"]
    assert pool.policy == Policy()  # the example shows the defaults


@pytest.mark.parametrize("value, ok", [(80, True), (100, True), (1, True), (0, False), (101, False), ("80", False),
                                        (True, False)])
def test_max_usage_percent_is_validated(value, ok):
    from codex_failover.config import ConfigError, parse_pool

    doc = {"credentials": [{"name": "a", "api_key_env": "K", "max_usage_percent": value}]}
    if ok:
        assert parse_pool(doc, "p.yaml", {"K": "sk-test-1"}, None).credentials[0].max_usage_percent == value
    else:
        with pytest.raises(ConfigError, match=r"credentials\[0\]\.max_usage_percent: expected a number from 1 to 100"):
            parse_pool(doc, "p.yaml", {"K": "sk-test-1"}, None)


@pytest.mark.parametrize("state, error", [
    ({"store": "memory"}, None),
    ({"store": "sqlite", "namespace": "team-a"}, None),
    ({"store": "sqlite:////var/lib/cf/state.sqlite"}, None),
    ({"store": "redis://localhost:6379/0"}, None),
    ({"store": "postgres://x"}, "expected sqlite, sqlite:///ABSOLUTE/PATH, redis://"),
    ({"namespace": "bad name!"}, "namespace: expected 1-64 letters"),
    ({"stor": "memory"}, "unknown field"),
])
def test_state_section(state, error):
    from codex_failover.config import ConfigError, parse_pool

    if error is None:
        assert parse_pool({"state": state}, "p.yaml", {}, None).state.store == state.get("store", "sqlite")
    else:
        with pytest.raises(ConfigError, match=error):
            parse_pool({"state": state}, "p.yaml", {}, None)
