"""Credentials as Codex keeps them: `auth.json` files and API keys. Pure: no network, no logging.

It reads what `codex login` (or a token refresh, core/token_refresh.py) wrote. An `AuthError` names
the file and the problem (and, for broken JSON, the line and column), never a token or key it holds;
an `AuthGone` is the kind that means "no credential here now" (the file is missing, empty, or
logged out: `"tokens": null`), which `codex login` fixes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

CHATGPT = "chatgpt"
APIKEY = "apikey"
AUTH_CLAIM = "https://api.openai.com/auth"


class AuthError(ValueError):
    pass


class AuthGone(AuthError):
    """The file holds no credential now: missing, empty, or logged out (`codex logout`)."""


@dataclass(frozen=True)
class AuthMaterial:
    """What goes on the wire for one account. `repr` never shows the secret."""

    kind: str  # CHATGPT or APIKEY
    token: str = field(repr=False)
    account_id: str | None = None
    fedramp: bool = False
    expires_at: float | None = None  # JWT `exp` of a ChatGPT access token
    # Declared in the pool file for an API-key credential (config.Credential applies them): sent as
    # OpenAI-Organization / OpenAI-Project on the attempts moved to this credential.
    organization: str | None = None
    project: str | None = None
    # ChatGPT login only: when Codex (or the addon) last refreshed it (`last_refresh`), and whether
    # the file has a refresh token at all. The refresh token itself is read from the file when used.
    last_refresh: float | None = None
    refreshable: bool = False

    @cached_property  # a request compares it with each pooled credential's
    def fingerprint(self) -> str:
        """A stable, non-reversible id for matching the same secret seen twice."""
        return fingerprint(self.token)

    @cached_property
    def account(self) -> str:
        """Who this is, across token refreshes: a ChatGPT login's account id and user (a refresh
        changes the token, never these), else the secret's fingerprint. Matching a pooled credential
        with the client's, sessions, usage and reset credits go by it."""
        if self.kind == CHATGPT and self.account_id:
            user = _auth_claim(jwt_claims(self.token))
            who = user.get("chatgpt_user_id") or user.get("user_id") or ""
            return fingerprint(f"chatgpt:{self.account_id}:{who}")
        return self.fingerprint

    def headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"}
        if self.kind == CHATGPT and self.account_id:
            headers["ChatGPT-Account-ID"] = self.account_id
        if self.fedramp:
            headers["X-OpenAI-Fedramp"] = "true"
        return headers

    def account_headers(self) -> dict[str, str]:
        """The account-scoping headers this credential declares (for moved attempts only)."""
        headers = {}
        if self.organization:
            headers["OpenAI-Organization"] = self.organization
        if self.project:
            headers["OpenAI-Project"] = self.project
        return headers


def fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def jwt_claims(token: str) -> dict[str, Any]:
    """The (unverified) claims of a JWT; {} when it is not one."""
    parts = token.split(".")
    if len(parts) != 3:
        return {}
    body = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(body))
    except (binascii.Error, ValueError):
        return {}
    return claims if isinstance(claims, dict) else {}


def auth_from_text(text: str, path: str | Path) -> AuthMaterial:
    """A Codex auth.json's text (read from `path`, named in the errors)."""
    if not text.strip():
        raise AuthGone(f"{path} is empty")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        # Position and problem only: the document (tokens) is never quoted.
        raise AuthError(f"{path} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg} "
                        "(expected a Codex auth.json)") from None
    except ValueError:
        raise AuthError(f"{path} is not valid JSON (expected a Codex auth.json)") from None
    if not isinstance(doc, dict):
        raise AuthError(f"{path}: expected a JSON object (a Codex auth.json)")
    return auth_from_document(doc, str(path))


def auth_from_document(doc: dict[str, Any], where: str) -> AuthMaterial:
    tokens = doc.get("tokens")
    if isinstance(tokens, dict) and isinstance(tokens.get("access_token"), str) and tokens["access_token"]:
        return _chatgpt_material(tokens, where, parse_time(doc.get("last_refresh")))
    key = doc.get("OPENAI_API_KEY")
    if isinstance(key, str) and key.strip():
        return AuthMaterial(APIKEY, key.strip())
    raise AuthGone(f"{where}: holds neither tokens.access_token nor OPENAI_API_KEY (logged out)")


def parse_time(value: object) -> float | None:
    """An RFC 3339 time as Codex writes `last_refresh` (nanoseconds allowed), as epoch seconds."""
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", value.strip())
    if m is None:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    try:
        at = datetime.fromisoformat(m.group(1) + zone).timestamp()
    except ValueError:
        return None
    return at + (float("0." + m.group(2)) if m.group(2) else 0.0)


def format_time(at: float) -> str:
    """Epoch seconds as Codex writes `last_refresh` (RFC 3339, UTC, microseconds)."""
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _chatgpt_material(tokens: dict[str, Any], where: str, last_refresh: float | None = None) -> AuthMaterial:
    access = tokens["access_token"]
    access_claims = jwt_claims(access)
    account = tokens.get("account_id")
    if not isinstance(account, str) or not account:
        id_token = tokens.get("id_token")
        id_claims = jwt_claims(id_token if isinstance(id_token, str) else "")
        account = _auth_claim(id_claims).get("chatgpt_account_id")
    if not isinstance(account, str) or not account:
        raise AuthError(f"{where}: no account id (tokens.account_id or the id_token's chatgpt_account_id)")
    auth_claim = _auth_claim(access_claims)
    exp = access_claims.get("exp")
    return AuthMaterial(
        CHATGPT,
        access,
        account_id=account,
        fedramp=bool(auth_claim.get("chatgpt_account_is_fedramp")),
        expires_at=float(exp) if isinstance(exp, (int, float)) else None,
        last_refresh=last_refresh,
        refreshable=isinstance(tokens.get("refresh_token"), str) and bool(tokens["refresh_token"]),
    )


def _auth_claim(claims: dict[str, Any]) -> dict[str, Any]:
    claim = claims.get(AUTH_CLAIM)
    return claim if isinstance(claim, dict) else {}


def auth_from_headers(headers: Mapping[str, str]) -> AuthMaterial | None:
    """The client's own credential, from the request it sent (None without a bearer token)."""
    value = headers.get("authorization", "")
    if not value.lower().startswith("bearer "):
        return None
    token = value[7:].strip()
    if not token:
        return None
    account = headers.get("chatgpt-account-id")
    kind = CHATGPT if account or token.count(".") == 2 else APIKEY
    return AuthMaterial(kind, token, account_id=account or None, fedramp=headers.get("x-openai-fedramp", "").lower() == "true")
