"""Moved attempts carry only what belongs to the new credential (issue 14 item 5).

The client's account-scoped headers (OpenAI-Organization, OpenAI-Project, x-codex-turn-state) never
go out with another credential; a pooled API key may declare its own organization / project, sent on
the attempts moved to it. A request on its own credential keeps its headers as the client sent them.
"""

from dataclasses import replace

import pytest
from conftest import WIRE
from mitmproxy.http import Headers

from codex_failover.bounded_file import read_auth_file
from codex_failover.config import ConfigError, Credential, parse_pool
from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.codex_request import swap_credential

KEY = AuthMaterial(APIKEY, "sk-pool")
KEY_SCOPED = AuthMaterial(APIKEY, "sk-pool", organization="org-pool", project="proj_pool")
KEY_ORG_ONLY = AuthMaterial(APIKEY, "sk-pool", organization="org-pool")
LOGIN = AuthMaterial(CHATGPT, "a.b.c", account_id="acct-pool")

CLIENT = {"Authorization": "Bearer sk-client", "OpenAI-Organization": "org-client", "OpenAI-Project": "proj_client",
          "x-codex-turn-state": "ts", "session-id": "s1"}
MIXED_CASE = {"authorization": "Bearer sk-client", "openai-ORGANIZATION": "org-client", "OPENAI-PROJECT": "proj_client",
              "X-Codex-Turn-State": "ts", "session-id": "s1"}
LOGIN_CLIENT = {"authorization": "Bearer x.y.z", "chatgpt-account-id": "acct-client", "session-id": "s1"}


@pytest.mark.parametrize(
    "sent,auth,moved,expected",
    [
        # moved, no declared org/project: the client's account headers are dropped
        (CLIENT, KEY, True, {"session-id": "s1", "Authorization": "Bearer sk-pool"}),
        (MIXED_CASE, KEY, True, {"session-id": "s1", "Authorization": "Bearer sk-pool"}),
        # moved, declared: the credential's own replace the client's
        (CLIENT, KEY_SCOPED, True, {"session-id": "s1", "Authorization": "Bearer sk-pool",
                                    "OpenAI-Organization": "org-pool", "OpenAI-Project": "proj_pool"}),
        (MIXED_CASE, KEY_SCOPED, True, {"session-id": "s1", "Authorization": "Bearer sk-pool",
                                        "OpenAI-Organization": "org-pool", "OpenAI-Project": "proj_pool"}),
        (MIXED_CASE, KEY_ORG_ONLY, True, {"session-id": "s1", "Authorization": "Bearer sk-pool",
                                          "OpenAI-Organization": "org-pool"}),
        # a request that had none gets the declared ones
        ({"authorization": "Bearer sk-client"}, KEY_SCOPED, True,
         {"Authorization": "Bearer sk-pool", "OpenAI-Organization": "org-pool", "OpenAI-Project": "proj_pool"}),
        # moved to a ChatGPT login (cross_kind): nothing of the API-key account goes along
        (MIXED_CASE, LOGIN, True, {"session-id": "s1", "Authorization": "Bearer a.b.c", "ChatGPT-Account-ID": "acct-pool"}),
        (LOGIN_CLIENT, LOGIN, True, {"session-id": "s1", "Authorization": "Bearer a.b.c", "ChatGPT-Account-ID": "acct-pool"}),
        # not moved (the client's own credential): its account headers stay as sent, declared ones are not added
        (CLIENT, KEY, False, {**{k: v for k, v in CLIENT.items() if k != "Authorization"}, "Authorization": "Bearer sk-pool"}),
        (MIXED_CASE, KEY_SCOPED, False, {**{k: v for k, v in MIXED_CASE.items() if k != "authorization"},
                                         "Authorization": "Bearer sk-pool"}),
        ({"authorization": "Bearer sk-client"}, KEY_SCOPED, False, {"Authorization": "Bearer sk-pool"}),
    ],
    ids=["moved-plain", "moved-plain-mixed-case", "moved-declared", "moved-declared-mixed-case", "moved-org-only",
         "moved-declared-into-bare-request", "moved-cross-kind", "moved-login", "own-plain", "own-declared-mixed-case",
         "own-declared-bare-request"],
)
def test_swap_credential(sent, auth, moved, expected):
    headers = dict(sent)
    swap_credential(headers, auth, moved)
    assert headers == expected


@pytest.mark.parametrize("moved", [True, False])
def test_swap_credential_on_mitmproxy_headers(moved):
    """The real header type: case-insensitive, and every spelling of a repeated header goes."""
    headers = Headers([(b"Authorization", b"Bearer sk-client"), (b"OpenAI-Organization", b"org-client"),
                       (b"openai-organization", b"org-client-2"), (b"OpenAI-Project", b"proj_client"),
                       (b"x-codex-turn-state", b"ts"), (b"session-id", b"s1")])
    swap_credential(headers, KEY_SCOPED, moved)
    assert headers["authorization"] == "Bearer sk-pool"
    assert headers["session-id"] == "s1"
    if moved:
        assert headers.get_all("openai-organization") == ["org-pool"]
        assert headers.get_all("openai-project") == ["proj_pool"]
        assert "x-codex-turn-state" not in headers
    else:
        assert headers.get_all("openai-organization") == ["org-client", "org-client-2"]
        assert headers["openai-project"] == "proj_client"
        assert headers["x-codex-turn-state"] == "ts"


def pool(**fields):
    entry = {"name": "spare", "api_key_env": "K", **fields}
    return parse_pool({"credentials": [entry]}, "p.yaml", {"K": "sk-spare"}, WIRE / "auth")


@pytest.mark.parametrize(
    "fields,organization,project",
    [
        ({}, None, None),
        ({"organization": "org-AbCdEf1234567890abcdEF12"}, "org-AbCdEf1234567890abcdEF12", None),
        ({"project": "proj_AbCdEf1234567890abcdEF12"}, None, "proj_AbCdEf1234567890abcdEF12"),
        ({"organization": "org-a", "project": "proj_b"}, "org-a", "proj_b"),
        ({"organization": "x" * 128}, "x" * 128, None),
        ({"project": "my project (staging)"}, None, "my project (staging)"),
    ],
)
def test_pool_organization_and_project(fields, organization, project):
    (cred,) = pool(**fields).credentials
    assert (cred.organization, cred.project) == (organization, project)
    assert (cred.auth.organization, cred.auth.project) == (organization, project)
    scoped = {k: v for k, v in (("OpenAI-Organization", organization), ("OpenAI-Project", project)) if v}
    assert cred.auth.account_headers() == scoped
    assert cred.auth.headers() == {"Authorization": "Bearer sk-spare"}  # the identity alone


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"organization": ""}, "credentials[0].organization: expected an organization id"),
        ({"organization": "   "}, "credentials[0].organization: expected an organization id"),
        ({"project": None}, "credentials[0].project: expected a project id"),
        ({"project": 42}, "credentials[0].project: expected a project id"),
        ({"organization": ["org-a"]}, "credentials[0].organization: expected an organization id"),
        ({"organization": " org-a"}, "credentials[0].organization: expected printable ASCII"),
        ({"project": "proj\n_b"}, "credentials[0].project: expected printable ASCII"),
        ({"project": "proj_\u00e9"}, "credentials[0].project: expected printable ASCII"),
        ({"organization": "x" * 129}, "credentials[0].organization: longer than 128 characters"),
        ({"organization": "sk-proj-abc"}, "credentials[0].organization: looks like an API key"),
        ({"project": "Bearer abc"}, "credentials[0].project: looks like an API key"),
    ],
)
def test_pool_organization_and_project_invalid(fields, needle):
    with pytest.raises(ConfigError) as info:
        pool(**fields)
    assert needle in str(info.value)
    for value in fields.values():
        if isinstance(value, str) and value.strip():
            assert value not in str(info.value)  # the value itself is never echoed


def test_chatgpt_login_takes_no_organization():
    doc = {"credentials": [{"name": "work", "auth_file": "auth.chatgpt.example.json", "organization": "org-a"}]}
    with pytest.raises(ConfigError, match=r"credentials\[0\]\.organization: only an API-key credential"):
        parse_pool(doc, "p.yaml", {}, WIRE / "auth")


def test_declared_fields_survive_an_auth_file_reload(tmp_path):
    """auth_watch swaps in the re-read material with dataclasses.replace(cred, auth=...): the
    credential re-applies its organization / project to it."""
    doc = {"credentials": [{"name": "k", "auth_file": "auth.apikey.example.json", "organization": "org-a",
                            "project": "proj_b"}]}
    (cred,) = parse_pool(doc, "p.yaml", {}, WIRE / "auth").credentials
    reloaded = replace(cred, auth=read_auth_file(WIRE / "auth" / "auth.apikey.example.json"))
    assert reloaded.auth.account_headers() == {"OpenAI-Organization": "org-a", "OpenAI-Project": "proj_b"}
    plain = Credential("p", KEY_SCOPED, "https://x/v1", "$X")  # the credential is the source of truth
    assert plain.auth.account_headers() == {}
    assert plain.auth.fingerprint == KEY_SCOPED.fingerprint


def test_example_pool_file_documents_organization_and_project():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for doc in (root / "rules" / "pool.example.yaml", root / "docs" / "pool-file.md"):
        text = doc.read_text()
        assert "organization:" in text, doc
        assert "project:" in text, doc
