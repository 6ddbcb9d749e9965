"""No configuration error message carries a secret (issue 14 item 4).

One row per error path, each with a secret planted in the input (a proxy or base_url password, a key
pasted where a name, path or URL belongs, a token in a broken auth.json): the message must name the
file and the field (and the line where the field is in the file) and must not contain the secret.
"""

import json

import pytest
import yaml

from codex_failover import config
from codex_failover.bounded_file import read_auth_file
from codex_failover.config import ConfigError, load_pool
from codex_failover.core.auth import AuthError
from codex_failover.core.routes import RouteError, looks_like_secret, parse_endpoint, redact_url

SECRET = "PLANTED-SECRET-7"
KEY = "sk-proj-PLANTED-SECRET-7abc123def456"
TOKEN = "PLANTEDSECRET7" + "0123456789abcdef" * 2  # a long random-looking token, no sk- prefix
ENV = {"K": "sk-env-PLANTED-SECRET-8"}  # the environment's key: never in a message either


def cred(**fields):
    entry = {"name": "a", "api_key_env": "K"}
    entry.update(fields)
    if "auth_file" in fields:
        del entry["api_key_env"]
    return {"credentials": [{k: v for k, v in entry.items() if v is not None}]}


def route(url):
    return {"routes": {"corp": [url]}}


def auth_with_claim(claim):
    """A ChatGPT auth.json without tokens.account_id whose id_token carries `claim` as the auth claim."""
    import base64
    body = base64.urlsafe_b64encode(json.dumps({"https://api.openai.com/auth": claim}).encode()).decode().rstrip("=")
    return json.dumps({"tokens": {"access_token": SECRET, "id_token": f"eyJhbGciOiJub25lIn0.{body}.", "refresh_token": SECRET}})


# (id, pool document, auth.json content written next to the pool file or None, field named, secret,
#  more text the message must hold, only the second line of defence (the scrub) keeps it out)
ROWS = [
    # routes: proxy URLs
    ("proxy-password-with-slash-and-hash", route(f"http://puser:pa/ss#{SECRET}@127.0.0.1:3128"), None,
     "routes.corp[0]", SECRET, "percent-encode", False),
    ("proxy-password-bad-port", route(f"http://puser:{SECRET}@127.0.0.1:notaport"), None,
     "routes.corp[0]", SECRET, "port", False),
    ("proxy-without-host", route(f"http://puser:{SECRET}"), None, "routes.corp[0]", SECRET, "port", False),
    ("proxy-port-out-of-range", route(f"http://puser:{SECRET}@proxy:99999"), None, "routes.corp[0]", SECRET, "port", False),
    ("proxy-host-invalid-under-nfkc", route(f"http://puser:{SECRET}@proxy\uff03x:3128"), None,
     "routes.corp[0]", SECRET, "malformed", False),
    ("proxy-bad-ipv6", route(f"http://puser:{SECRET}@[::1:3128"), None, "routes.corp[0]", SECRET, "malformed", False),
    ("proxy-unsupported-scheme", route(f"ftp://puser:{SECRET}@proxy:21"), None,
     "routes.corp[0]", SECRET, "unsupported scheme 'ftp'", False),
    ("proxy-without-scheme", route(f"puser:{SECRET}@proxy:3128"), None, "routes.corp[0]", SECRET, "scheme://", False),
    ("proxy-with-path-and-query", route(f"http://puser:{SECRET}@proxy:3128/x?token={SECRET}"), None,
     "routes.corp[0]", SECRET, "http://***@proxy:3128/x?***", False),
    ("route-given-one-url-not-a-list", {"routes": {"corp": f"http://puser:{SECRET}@proxy:3128"}}, None,
     "routes.corp", SECRET, "in a list", False),
    ("route-name-is-a-url", {"routes": {f"http://puser:{SECRET}@proxy:3128": ["http://p:1"]}}, None,
     "routes", SECRET, "route name", False),
    ("credential-route-is-a-url", cred(route=f"http://puser:{SECRET}@proxy:3128"), None,
     "credentials[0].route", SECRET, "not a URL", False),
    ("credential-route-is-a-key", cred(route=KEY), None, "credentials[0].route", KEY, "not a URL or a secret", False),
    # api_key_env: a key pasted instead of a variable name
    ("api-key-env-is-a-key", cred(api_key_env=KEY), None, "credentials[0].api_key_env", KEY,
     "looks like an API key, not the name of an environment variable", False),
    ("api-key-env-is-an-assignment", cred(api_key_env=f"OPENAI_API_KEY={KEY}"), None, "credentials[0].api_key_env",
     KEY, "looks like an API key", False),
    ("api-key-env-is-a-bearer-value", cred(api_key_env=f"Bearer {TOKEN}"), None, "credentials[0].api_key_env",
     TOKEN, "looks like an API key", False),
    ("api-key-env-is-a-long-token", cred(api_key_env=TOKEN), None, "credentials[0].api_key_env", TOKEN,
     "looks like an API key", False),
    ("api-key-env-is-short-and-invalid", cred(api_key_env="x$PLANT7"), None, "credentials[0].api_key_env",
     "x$PLANT7", "not a valid environment variable name", False),
    # base_url / base_urls
    ("base-url-password-bad-port", cred(base_url=f"https://user:{SECRET}@api.example:notaport/v1"), None,
     "credentials[0].base_url", SECRET, "credentials in the URL are not allowed", False),
    ("base-url-password-with-slash", cred(base_url=f"https://user:pa/ss#{SECRET}@api.example/v1"), None,
     "credentials[0].base_url", SECRET, "https://***@api.example/v1", False),
    ("base-url-bad-scheme-with-password", cred(base_url=f"ftp://user:{SECRET}@api.example/v1"), None,
     "credentials[0].base_url", SECRET, "credentials in the URL", False),
    ("base-url-token-in-query", cred(base_url=f"https://api.example/v1?api_key={SECRET}"), None,
     "credentials[0].base_url", SECRET, "without query", False),
    ("base-url-token-in-fragment", cred(base_url=f"https://api.example/v1#{SECRET}"), None,
     "credentials[0].base_url", SECRET, "https://api.example/v1#***", False),
    ("base-url-key-in-path-bad-scheme", cred(base_url=f"ftp://api.example/{KEY}/v1"), None,
     "credentials[0].base_url", KEY, "ftp://api.example/***/v1", False),
    ("base-url-bad-port-no-password", cred(base_url=f"https://api.example:{SECRET}/v1"), None,
     "credentials[0].base_url", SECRET, "port", False),
    ("base-url-is-a-key", cred(base_url=KEY), None, "credentials[0].base_url", KEY, "http(s) URL", False),
    ("base-url-bad-ipv6", cred(base_url=f"https://[{SECRET}/v1"), None, "credentials[0].base_url", SECRET,
     "malformed", False),
    ("base-urls-entry-with-password", {"base_urls": [f"https://user:{SECRET}@api.example/v1"]}, None,
     "base_urls[0]", SECRET, "credentials in the URL", False),
    # auth_file and the auth.json it names
    ("auth-file-is-a-key", cred(auth_file=KEY), None, "credentials[0].auth_file", KEY, "not a path", False),
    ("auth-file-path-holds-a-key", cred(auth_file=f"/nonexistent/{KEY}/auth.json"), None,
     "credentials[0].auth_file", KEY, "cannot read", False),
    ("auth-json-truncated", cred(auth_file="auth.json"), f'{{"tokens": {{"access_token": "{SECRET}", "account_id": "x"',
     "credentials[0].auth_file", SECRET, "not valid JSON at line 1", False),
    ("auth-json-bad-escape", cred(auth_file="auth.json"), f'{{"OPENAI_API_KEY": "{SECRET}\\q"}}',
     "credentials[0].auth_file", SECRET, "not valid JSON", False),
    ("auth-json-not-utf8", cred(auth_file="auth.json"), f'{{"OPENAI_API_KEY": "{SECRET}'.encode() + b'\xff"}',
     "credentials[0].auth_file", SECRET, "not UTF-8", False),
    ("auth-json-not-an-object", cred(auth_file="auth.json"), json.dumps([SECRET]),
     "credentials[0].auth_file", SECRET, "expected a JSON object", False),
    ("auth-json-no-account-id", cred(auth_file="auth.json"), json.dumps({"tokens": {"access_token": SECRET}}),
     "credentials[0].auth_file", SECRET, "no account id", False),
    ("auth-json-auth-claim-not-a-mapping", cred(auth_file="auth.json"), auth_with_claim(SECRET),
     "credentials[0].auth_file", SECRET, "no account id", False),
    ("auth-json-neither-token-nor-key", cred(auth_file="auth.json"),
     json.dumps({"OPENAI_API_KEY": None, "tokens": {"access_token": 5, "refresh_token": SECRET}}),
     "credentials[0].auth_file", SECRET, "neither tokens.access_token nor OPENAI_API_KEY", False),
    # names and other fields given a key by mistake
    ("name-is-a-long-key", cred(name=KEY + "x" * 40), None, "credentials[0].name", KEY, "not shown", False),
    ("name-holds-a-key", cred(name=f"key {KEY}"), None, "credentials[0].name", KEY, "not shown", False),
    ("priority-is-a-key", cred(priority=KEY), None, "credentials[0].priority", KEY, "whole number", False),
    ("credential-field-named-by-a-key", cred(**{KEY: 1}), None, "credentials[0]", KEY, "unknown field(s)", False),
    ("top-level-field-named-by-a-key", {KEY: 1}, None, None, KEY, "unknown field(s)", False),
    ("policy-int-is-a-key", {"policy": {"max_attempts": KEY}}, None, "policy.max_attempts", KEY, "whole number", False),
    ("policy-bool-is-a-key", {"policy": {"cross_kind": KEY}}, None, "policy.cross_kind", KEY, "true or false", False),
    ("policy-choice-is-a-key", {"policy": {"selection": KEY}}, None, "policy.selection", KEY, "expected one of", False),
    ("policy-duration-is-a-key", {"policy": {"bootstrap_timeout": KEY}}, None, "policy.bootstrap_timeout", KEY,
     "not a duration", False),
    ("organization-is-a-key", cred(organization=KEY), None, "credentials[0].organization", KEY,
     "looks like an API key", False),
    ("project-too-long", cred(project=SECRET + "x" * 200), None, "credentials[0].project", SECRET,
     "longer than 128", False),
    ("organization-not-printable", cred(organization=SECRET + "\n"), None, "credentials[0].organization", SECRET,
     "printable", False),
    # recovery.py (parse_recovery echoes its values): only the scrub in parse_pool keeps keys out
    ("recovery-duration-is-a-key", {"recovery": {"retry_window": KEY}}, None, "recovery.retry_window", KEY,
     "not a duration", True),
    ("recovery-enabled-is-a-key", {"recovery": {"enabled": KEY}}, None, "recovery.enabled", KEY, "true or false", True),
    ("recovery-size-is-a-key", {"recovery": {"max_buffer_bytes": KEY}}, None, "recovery.max_buffer_bytes", KEY,
     "not a size", True),
]


def write(tmp_path, doc, auth):
    if auth is not None:
        (tmp_path / "auth.json").write_bytes(auth if isinstance(auth, bytes) else auth.encode())
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return path


def assert_clean(message, secret):
    for value in (secret, secret.lower(), *ENV.values()):
        assert value not in message, message


FATAL = [r for r in ROWS if r[2] is None]  # an auth.json that cannot be used skips its credential instead


@pytest.mark.parametrize("name,doc,auth,field,secret,needle,scrub_only",
                         [r for r in ROWS if r[2] is not None], ids=[r[0] for r in ROWS if r[2] is not None])
def test_unusable_auth_file_skips_its_credential_without_the_secret(tmp_path, name, doc, auth, field, secret, needle,
                                                                   scrub_only):
    """A credential whose auth.json cannot be used is skipped, never fatal: its problem (the line
    the proxy logs) names the file and never quotes what the file holds."""
    path = write(tmp_path, doc, auth)
    pool = load_pool(path, ENV)
    assert pool.credentials == ()
    (skip,) = pool.skipped
    assert skip.name == "a"
    assert str(tmp_path / "auth.json") in skip.problem
    assert needle in skip.problem
    assert_clean(skip.line("codex login"), secret)


@pytest.mark.parametrize("name,doc,auth,field,secret,needle,scrub_only", FATAL, ids=[r[0] for r in FATAL])
def test_error_names_file_field_line_and_never_the_secret(tmp_path, name, doc, auth, field, secret, needle, scrub_only):
    path = write(tmp_path, doc, auth)
    with pytest.raises(ConfigError) as info:
        load_pool(path, ENV)
    message = str(info.value)
    assert message.startswith(f"pool file {path}: "), message
    if field is not None:
        assert message.startswith(f"pool file {path}: {field}"), message
        assert "(line " in message, message
    assert needle in message, message
    assert_clean(message, secret)


@pytest.mark.parametrize("name,doc,auth,field,secret,needle,scrub_only",
                         [r for r in FATAL if not r[-1]], ids=[r[0] for r in FATAL if not r[-1]])
def test_no_message_formats_a_secret_even_without_the_scrub(tmp_path, name, doc, auth, field, secret, needle, scrub_only):
    """The first line of defence alone: each message is built without the secret."""
    write(tmp_path, doc, auth)
    with pytest.raises(ConfigError) as info:
        config._parse_pool(doc, "p.yaml", ENV, tmp_path)
    assert_clean(str(info.value), secret)


@pytest.mark.parametrize("name,doc,auth,field,secret,needle,scrub_only",
                         [r for r in ROWS if r[2] is not None], ids=[r[0] for r in ROWS if r[2] is not None])
def test_auth_file_errors_never_quote_a_token(tmp_path, name, doc, auth, field, secret, needle, scrub_only):
    """What auth_watch logs when a changed auth.json cannot be used: the same AuthError text."""
    path = write(tmp_path, doc, auth).parent / "auth.json"
    with pytest.raises(AuthError) as info:
        read_auth_file(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)
    assert_clean(str(info.value), secret)


@pytest.mark.parametrize(
    "url,shown",
    [
        ("http://puser:pa/ss#7@127.0.0.1:3128", "http://***@127.0.0.1:3128"),
        ("https://user:pass@host:notaport/v1", "https://***@host:***/v1"),
        ("http://puser:secret", "http://puser:***"),
        ("http://u:p@ss@proxy:1", "http://***@proxy:1"),
        ("http://[::1]:8080/a?x=1#f", "http://[::1]:8080/a?***"),
        ("https://gw.example/key/sk-proj-abc/v1", "https://gw.example/key/***/v1"),
        ("user:secret@proxy:3128", "(not shown: no scheme://)"),
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "text,secret",
    [
        ("sk-proj-abc", True), ("OPENAI_API_KEY=sk-abc", True), ("Bearer abc", True), ("eyJhbGciOiJub25lIn0", True),
        (TOKEN, True), ("x" * 65, True),
        ("SPARE_OPENAI_KEY", False), ("work", False), ("corp", False), ("backend-api", False), ("eyjafjalla", False),
        ("org-AbCdEf1234567890abcdEF12", False), ("proj_AbCdEf1234567890abcdEF12", False),
    ],
)
def test_looks_like_secret(text, secret):
    assert looks_like_secret(text) is secret


def test_percent_encoded_password_still_parses():
    ep = parse_endpoint("corp", 0, f"http://puser:pa%2Fss%23{SECRET}@127.0.0.1:3128")
    assert (ep.host, ep.port, ep.password) == ("127.0.0.1", 3128, f"pa/ss#{SECRET}")
    assert SECRET not in ep.label
    assert SECRET not in repr(ep)


def test_route_errors_from_parse_endpoint_alone():
    with pytest.raises(RouteError) as info:
        parse_endpoint("corp", 2, f"http://puser:{SECRET}@proxy:0")
    assert str(info.value).startswith("routes.corp[2]: ")
    assert SECRET not in str(info.value)


def test_non_secret_values_are_still_echoed(tmp_path):
    path = write(tmp_path, {"policy": {"max_attempts": 99}}, None)
    with pytest.raises(ConfigError, match=r"policy\.max_attempts: expected a whole number from 1 to 32, got 99"):
        load_pool(path, ENV)
    path = write(tmp_path, cred(api_key_env="MISSING_VAR"), None)
    with pytest.raises(ConfigError, match="environment variable MISSING_VAR is not set or empty"):
        load_pool(path, ENV)


def test_scrub_replaces_whole_pieces_only():
    """The second line of defence masks a planted password without mangling the text around it."""
    doc = {"routes": {"corp": ["http://user:pass@proxy:3128/path"]}}
    with pytest.raises(ConfigError) as info:
        config.parse_pool(doc, "p.yaml", ENV, None)
    assert "[user:password@]" in str(info.value)
    assert "(http://***@proxy:3128/path)" in str(info.value)
    assert config._scrub("got 'pass' and password", doc) == "got '***' and password"
