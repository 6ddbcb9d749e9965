"""Credentials as Codex keeps them: `auth.json` files and API keys. Pure: no network, no logging.

The addon never refreshes a token (refresh tokens are single-use and a running Codex may own
them); it only reads what `codex login` wrote. An `AuthError` names the file and the problem
(and, for broken JSON, the line and column), never a token or key it holds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

CHATGPT = "chatgpt"
APIKEY = "apikey"
AUTH_CLAIM = "https://api.openai.com/auth"


class AuthError(ValueError):
    pass


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

    @cached_property  # a request compares it with each pooled credential's
    def fingerprint(self) -> str:
        """A stable, non-reversible id for matching the same secret seen twice."""
        return fingerprint(self.token)

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


def read_auth_file(path: str | Path) -> AuthMaterial:
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthError(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError as exc:
        raise AuthError(f"{path} is not UTF-8 text (byte {exc.start + 1}; expected a Codex auth.json)") from None
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
        return _chatgpt_material(tokens, where)
    key = doc.get("OPENAI_API_KEY")
    if isinstance(key, str) and key.strip():
        return AuthMaterial(APIKEY, key.strip())
    raise AuthError(f"{where}: holds neither tokens.access_token nor OPENAI_API_KEY (run `codex login`)")


def _chatgpt_material(tokens: dict[str, Any], where: str) -> AuthMaterial:
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
