"""The clients' own tokens the usage re-check asks with (core/own_tokens.py): a token claiming an
account never displaces the one the upstream accepted for it; and the re-check that judges them
(mitm/account_back.py), with the usage endpoint scripted."""

from __future__ import annotations

import asyncio
import base64
import json
import types

import pytest

from codex_failover.core import own_tokens as ot
from codex_failover.core.auth import auth_from_headers
from codex_failover.core.planner import client_key

REAL, FORGED, NEWER = "real", "forged", "newer"


def test_a_new_token_waits_beside_the_held_one_until_the_upstream_accepts_it():
    book = ot.OwnTokens(limit=8)
    book.saw("k", REAL)
    assert book.to_try("k") == [REAL]
    book.answered("k", REAL, ot.ACCEPTED)
    assert book.to_try("k") == [REAL]
    book.saw("k", FORGED)  # another client's token claiming the same account
    assert book.to_try("k") == [FORGED, REAL]  # tried first, the accepted one kept
    book.answered("k", FORGED, ot.REFUSED)
    assert book.to_try("k") == [REAL]  # dropped: the real one is what the re-check asks with
    book.saw("k", NEWER)  # the client's own Codex refreshed
    book.answered("k", NEWER, ot.ACCEPTED)
    assert book.to_try("k") == [NEWER]  # it replaces the held one
    book.saw("k", FORGED)
    book.answered("k", FORGED, ot.OTHER)  # a 5xx says nothing about the token
    assert book.to_try("k") == [FORGED, NEWER]


def test_a_forged_token_seen_first_is_displaced_by_the_real_one():
    book = ot.OwnTokens(limit=8)
    book.saw("k", FORGED)
    book.answered("k", FORGED, ot.REFUSED)
    book.saw("k", REAL)
    assert book.to_try("k") == [REAL]
    book.answered("k", REAL, ot.ACCEPTED)
    book.saw("k", REAL)  # the same token again: nothing new to judge
    assert book.to_try("k") == [REAL]


def test_at_most_limit_keys_the_least_recently_seen_out_first():
    book = ot.OwnTokens(limit=2)
    for key in ("a", "b", "c"):
        book.saw(key, REAL)
    assert list(book) == ["b", "c"] and book.to_try("a") == []


@pytest.mark.parametrize("status,verdict", [(200, ot.ACCEPTED), (204, ot.ACCEPTED), (401, ot.REFUSED),
                                            (403, ot.REFUSED), (429, ot.OTHER), (500, ot.OTHER)])
def test_what_an_answer_says_of_the_token(status, verdict):
    assert ot.verdict(status) == verdict


# -- the re-check (mitm/account_back.py) ------------------------------------------------------------


def jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"


CLAIMS = {"https://api.openai.com/auth": {"chatgpt_account_id": "acct-A", "chatgpt_user_id": "user-A"}, "exp": 2e9}


def client(n) -> object:
    return auth_from_headers({"authorization": f"Bearer {jwt({**CLAIMS, 'n': n})}", "chatgpt-account-id": "acct-A"})


def test_a_forged_token_cannot_take_the_own_accounts_recheck(monkeypatch):
    """p9: two tokens with the same (unsigned) claims share the own account's key; the one the
    upstream refuses never displaces the one it accepted, and the re-check still ends the cooldown."""
    from codex_failover.core.health import Health
    from codex_failover.core.policy import Policy, PoolConfig
    from codex_failover.core.usage import UsageBook
    from codex_failover.core.vocabulary import USAGE_LIMIT
    from codex_failover.mitm import account_back

    real, forged = client("real"), client("forged")
    key = client_key(real)
    assert key == client_key(forged) and real.token != forged.token  # what makes the rule necessary
    health = Health()
    owner = types.SimpleNamespace(pool=PoolConfig((), Policy(usage_recheck=60.0)), health=health, usage=UsageBook(),
                                  shared=lambda: types.SimpleNamespace(bridges=None, upstream_tls=None))
    back = account_back.AccountBack(owner)
    asked = []

    async def get_json(url, headers, via, bridges, tls, timeout):
        token = headers["Authorization"].removeprefix("Bearer ")
        asked.append("real" if token == real.token else "forged")
        if token != real.token:
            return 401, None  # the upstream checks the signature this proxy cannot
        return 200, {"rate_limit": {"allowed": True, "limit_reached": False}}

    monkeypatch.setattr(account_back, "get_json", get_json)
    url = "https://chatgpt.com/backend-api/codex/responses"
    back.saw_client(real, url)
    health.cool(key, 7 * 86400, USAGE_LIMIT)
    back.recheck.every = 60.0
    monkeypatch.setattr(account_back, "usage_has_headroom", lambda doc, full_at: False)
    asyncio.run(back.check_due())
    assert asked == ["real"]
    back.saw_client(forged, url)  # another client, claiming A's account and user
    back.recheck._checked.clear()
    asyncio.run(back.check_due())
    assert asked == ["real", "forged", "real"]  # the forged one tried, refused, the real one asked
    assert back.own.to_try(key) == [(real, "https://chatgpt.com/backend-api/codex")]
    monkeypatch.setattr(account_back, "usage_has_headroom", lambda doc, full_at: True)
    back.saw_client(forged, url)
    back.recheck._checked.clear()
    asyncio.run(back.check_due())
    assert health.state(key).status != "cooling"  # the own account came back despite the forgery
