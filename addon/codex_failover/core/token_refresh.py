"""Refreshing a pooled ChatGPT login's tokens, as Codex does (codex-rs `login/src/auth/manager.rs`):
when, and what the token endpoint's answer means. Pure: no I/O, the clock passed in.

When: an access token that has ended or ends within BEFORE_EXPIRY (and was not refreshed in the
last MIN_AGE), or a login last refreshed more than INTERVAL ago (Codex's 8 days), is refreshed ahead of use; a 401 from the model API on a pooled
credential forces one refresh of that token (once: a fresh token refused again stays out). One
refresh per account at a time (`Refreshes`, a small state machine with a transition table); a
transient failure waits (doubling from RETRY_FIRST), a permanent one (`refresh_token_expired`,
`refresh_token_invalidated`, `invalid_grant`, any other 401) waits for a new login. Never the
client's own credential: its Codex owns it.

The answer: a 200 carries new tokens (any of id_token, access_token, refresh_token), written back
into the same auth.json with `last_refresh` set, `tokens.account_id` kept (`merge`);
`refresh_token_reused` means someone else (the account's own Codex, another proxy) refreshed
first: the file is read again, never the refresh retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .auth import CHATGPT, AuthMaterial, format_time

CLIENT_ID = "app_EMoamEEZ73f0CkXaXp7hrann"
DEFAULT_URL = "https://auth.openai.com/oauth/token"
INTERVAL = 8 * 24 * 3600.0  # Codex's TOKEN_REFRESH_INTERVAL
BEFORE_EXPIRY = 24 * 3600.0  # an access token ending within this is refreshed ahead of its end
MIN_AGE = 3600.0  # ... unless refreshed less than this ago (a short-lived token is not refreshed in a loop)
RETRY_FIRST = 60.0  # after a transient failure, doubling
RETRY_MAX = 3600.0
CLAIM_TTL = 60.0  # a shared store's claim on an account's refresh lasts at most this

# Why a refresh is due (the log line's words).
EXPIRING = "its access token ends within a day"
EXPIRED = "its access token has expired"
STALE = "last refreshed over 8 days ago"
AFTER_401 = "upstream answered 401"

REUSED = "refresh_token_reused"
PERMANENT_CODES = ("refresh_token_expired", "refresh_token_invalidated", "invalid_grant")

# States of one account's refresh.
IDLE = "idle"
REFRESHING = "refreshing"
WAITING = "waiting"  # a transient failure: not before `until`
REFUSED = "refused"  # a permanent failure: until the token changes (a new login)

# Events.
START = "start"
DONE = "done"
TRANSIENT = "transient"
PERMANENT = "permanent"
NEW_TOKEN = "new_token"

TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, START): REFRESHING,
    (WAITING, START): REFRESHING,
    (REFRESHING, DONE): IDLE,
    (REFRESHING, TRANSIENT): WAITING,
    (REFRESHING, PERMANENT): REFUSED,
    (WAITING, NEW_TOKEN): IDLE,
    (REFUSED, NEW_TOKEN): IDLE,
    (IDLE, NEW_TOKEN): IDLE,
    (REFRESHING, NEW_TOKEN): REFRESHING,  # its own result decides
}


def request_doc(refresh_token: str) -> dict[str, str]:
    """The JSON body Codex posts."""
    return {"client_id": CLIENT_ID, "grant_type": "refresh_token", "refresh_token": refresh_token}


@dataclass(frozen=True)
class Refreshed:
    tokens: dict[str, str]  # the new id_token / access_token / refresh_token that came


@dataclass(frozen=True)
class Reused:
    """`refresh_token_reused`: someone else refreshed first; read the file again."""


@dataclass(frozen=True)
class Permanent:
    code: str  # one of PERMANENT_CODES, or "HTTP 401" (never a text the endpoint chose)


@dataclass(frozen=True)
class Transient:
    why: str  # "HTTP 503", "an answer without tokens"


Outcome = Refreshed | Reused | Permanent | Transient


def failure_code(doc: object) -> str | None:
    """The error code where Codex looks for it: `error.code`, `error` as a string, or `code`."""
    if not isinstance(doc, dict):
        return None
    error = doc.get("error")
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        return str(error["code"])
    if isinstance(error, str):
        return error
    code = doc.get("code")
    return code if isinstance(code, str) else None


def judge(status: int, doc: object) -> Outcome:
    """What the token endpoint's answer means. Only known codes are ever repeated (the answer
    itself never reaches a log)."""
    if status == 200:
        tokens = {k: doc[k] for k in ("id_token", "access_token", "refresh_token")
                  if isinstance(doc, dict) and isinstance(doc.get(k), str) and doc[k]}
        return Refreshed(tokens) if tokens else Transient("an answer without tokens")
    code = failure_code(doc)
    if code == REUSED:
        return Reused()
    if code in PERMANENT_CODES:
        return Permanent(code)
    if status == 401:
        return Permanent("HTTP 401")
    return Transient(f"HTTP {status}")


def merge(doc: dict[str, Any], tokens: dict[str, str], now: float) -> dict[str, Any]:
    """`doc` (an auth.json) with the new tokens and `last_refresh`, everything else as it was
    (`tokens.account_id` included: a refresh does not change it)."""
    out = dict(doc)
    out["tokens"] = {**(doc.get("tokens") or {}), **tokens}
    out["last_refresh"] = format_time(now)
    return out


def reason_due(auth: AuthMaterial, now: float) -> str | None:
    """Why `auth` is due a proactive refresh now, or None."""
    if auth.kind != CHATGPT or not auth.refreshable:
        return None
    if auth.expires_at is not None and auth.expires_at <= now:
        return EXPIRED
    if auth.expires_at is not None and auth.expires_at - now <= BEFORE_EXPIRY and (
            auth.last_refresh is None or now - auth.last_refresh >= MIN_AGE):
        return EXPIRING
    if auth.last_refresh is None or now - auth.last_refresh >= INTERVAL:
        return STALE
    return None


@dataclass
class _Account:
    state: str = IDLE
    until: float = 0.0  # WAITING: not before
    failures: int = 0  # transient ones in a row
    token: str = ""  # fingerprint of the token the last state is about
    forced: str = ""  # fingerprint of the token a 401 already forced a refresh for


class Refreshes:
    """Each account's refresh state (keyed by `AuthMaterial.account`): single-flight, backoff,
    permanent failures, and the once-per-token forced refresh after a 401."""

    def __init__(self) -> None:
        self._accounts: dict[str, _Account] = {}

    def state(self, account: str) -> str:
        entry = self._accounts.get(account)
        return entry.state if entry else IDLE

    def _go(self, entry: _Account, event: str) -> None:
        entry.state = TRANSITIONS[(entry.state, event)]

    def due(self, auth: AuthMaterial, now: float, after_401: bool = False) -> str | None:
        """Why `auth` should be refreshed now (None: not now). `after_401`: upstream refused this
        token (a forced refresh, once per token)."""
        if auth.kind != CHATGPT or not auth.refreshable:
            return None
        entry = self._accounts.setdefault(auth.account, _Account())
        if entry.token and entry.token != auth.fingerprint and entry.state != REFRESHING:
            self._go(entry, NEW_TOKEN)  # a new login or someone else's refresh: start afresh
            entry.failures = 0
        if entry.state in (REFRESHING, REFUSED) or (entry.state == WAITING and now < entry.until):
            return None
        if after_401:
            return None if entry.forced == auth.fingerprint else AFTER_401
        return reason_due(auth, now)

    def start(self, auth: AuthMaterial, reason: str) -> None:
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, START)
        entry.token = auth.fingerprint
        if reason == AFTER_401:
            entry.forced = auth.fingerprint

    def done(self, auth: AuthMaterial, new: AuthMaterial) -> None:
        """Refreshed (by us, or found refreshed in the file): `new` is in force."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, DONE)
        entry.failures, entry.token = 0, new.fingerprint

    def transient(self, auth: AuthMaterial, now: float) -> float:
        """A transient failure: the seconds until the next try."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, TRANSIENT)
        wait = float(min(RETRY_MAX, RETRY_FIRST * 2.0 ** entry.failures))
        entry.failures += 1
        entry.until = now + wait
        return wait

    def elsewhere(self, auth: AuthMaterial, now: float) -> None:
        """Another proxy holds the account's refresh (a shared store's claim): look again after
        CLAIM_TTL, when its result is in the file or its claim has lapsed. Not a failure."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, TRANSIENT)
        entry.until = now + CLAIM_TTL

    def permanent(self, auth: AuthMaterial) -> None:
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, PERMANENT)
        entry.token = auth.fingerprint
