"""Refreshing a pooled ChatGPT login's tokens, as Codex does (codex-rs `login/src/auth/manager.rs`):
when, and what the token endpoint's answer means. Pure: no I/O, the clock passed in.

When: an access token that has ended or ends within BEFORE_EXPIRY (and was not refreshed in the
last MIN_AGE), or a login last refreshed more than INTERVAL ago (Codex's 8 days), is refreshed ahead of use; a 401 from the model API on a pooled
credential forces one refresh (once per login: the token that refresh gave, refused again, stays
out of rotation until a new login, `REFUSED_AGAIN`). One refresh per account at a time
(`Refreshes`, a small state machine with a transition table); a transient failure waits (doubling
from RETRY_FIRST), a permanent one (`refresh_token_expired`, `refresh_token_invalidated`,
`invalid_grant`, any other 401) waits for a new login. An exchange whose answer never came (no
answer within ANSWER_TIMEOUT, or the connection closed first) may still have rotated the token at
the endpoint: the next try reads the file first, and a `refresh_token_reused` then is answered by
reading it again and one more try after REUSED_WAIT before the login counts as refused. Never the
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
ANSWER_TIMEOUT = 30.0  # the token endpoint's answer, once the request is sent (connecting: policy.connect_timeout)
REUSED_WAIT = 5.0  # after an unanswered exchange, refresh_token_reused: the one more try waits this
CLAIM_TTL = 2 * ANSWER_TIMEOUT + REUSED_WAIT + 25.0  # a shared store's claim on an account's refresh lasts at most this

# Why a refresh is due (the log line's words).
EXPIRING = "its access token ends within a day"
EXPIRED = "its access token has expired"
STALE = "last refreshed over 8 days ago"
AFTER_401 = "upstream answered 401"
REFUSED_AGAIN = "upstream answered 401 to the token its forced refresh gave"  # not a refresh: out until a new login

REUSED = "refresh_token_reused"
PERMANENT_CODES = ("refresh_token_expired", "refresh_token_invalidated", "invalid_grant")

# States of one account's refresh.
IDLE = "idle"
REFRESHING = "refreshing"
WAITING = "waiting"  # a transient failure: not before `until`
REFUSED = "refused"  # a permanent failure: until the token changes (a new login)
UNANSWERED = "unanswered"  # the last exchange got no answer (the endpoint may have rotated): not before `until`
CHECKING = "checking"  # refreshing after an unanswered exchange: a refresh_token_reused earns one more try
RETRYING = "retrying"  # that one more try

IN_FLIGHT = (REFRESHING, CHECKING, RETRYING)

# Events.
START = "start"
DONE = "done"
TRANSIENT = "transient"
NO_ANSWER = "no_answer"
REUSED_EVENT = "reused"  # refresh_token_reused, the file unchanged
PERMANENT = "permanent"
NEW_TOKEN = "new_token"

TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, START): REFRESHING,
    (WAITING, START): REFRESHING,
    (UNANSWERED, START): CHECKING,
    (CHECKING, REUSED_EVENT): RETRYING,
    **{(s, DONE): IDLE for s in IN_FLIGHT},
    **{(s, TRANSIENT): WAITING for s in IN_FLIGHT},
    **{(s, NO_ANSWER): UNANSWERED for s in IN_FLIGHT},
    **{(s, PERMANENT): REFUSED for s in IN_FLIGHT},
    (WAITING, NEW_TOKEN): IDLE,
    (UNANSWERED, NEW_TOKEN): IDLE,
    (REFUSED, NEW_TOKEN): IDLE,
    (IDLE, NEW_TOKEN): IDLE,
    **{(s, NEW_TOKEN): s for s in IN_FLIGHT},  # its own result decides
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


Snapshot = tuple[int, int, int, str, str]  # (inode, mtime_ns, size, refresh_token, account_id) of an auth.json


def snapshot(stamp: tuple[int, int, int], doc: dict[str, Any]) -> Snapshot:
    """What says an auth.json is still the one read: its file (an atomic rewrite by Codex changes
    the inode, an edit the mtime or size) and its login (refresh token and account)."""
    tokens = doc.get("tokens") if isinstance(doc.get("tokens"), dict) else {}
    refresh, account = (tokens or {}).get("refresh_token"), (tokens or {}).get("account_id")
    return (*stamp, refresh if isinstance(refresh, str) else "", account if isinstance(account, str) else "")


def still_the_one(read: Snapshot, now: Snapshot | None) -> bool:
    """May a refresh's new tokens replace the file now (`now`: None when it is gone)? Only when it
    is the file the refresh read: Codex takes no lock, so a `codex logout` (the file removed) or a
    `codex login` (another login written) while the exchange was under way wins over the refresh."""
    return now is not None and now == read


def same_login(read: Snapshot, now: Snapshot | None) -> bool:
    """The file changed but holds the login the refresh sent (its refresh token, its account): only
    rewritten (an editor, a copy back). The new tokens still belong in it: that refresh token is spent
    now, so leaving it there would lose the login."""
    return now is not None and bool(read[3]) and now[3:] == read[3:]


@dataclass
class _Account:
    state: str = IDLE
    until: float = 0.0  # WAITING / UNANSWERED: not before
    failures: int = 0  # transient ones in a row
    token: str = ""  # fingerprint of the token the last state is about
    reason: str = ""  # why the refresh under way started
    fresh: str = ""  # fingerprint of the token a 401's forced refresh gave (a 401 on it: REFUSED_AGAIN)


class Refreshes:
    """Each account's refresh state (keyed by `AuthMaterial.account`): single-flight, backoff,
    permanent failures, and the once-per-login forced refresh after a 401."""

    def __init__(self) -> None:
        self._accounts: dict[str, _Account] = {}

    def state(self, account: str) -> str:
        entry = self._accounts.get(account)
        return entry.state if entry else IDLE

    def _go(self, entry: _Account, event: str) -> None:
        entry.state = TRANSITIONS[(entry.state, event)]

    def due(self, auth: AuthMaterial, now: float, after_401: bool = False) -> str | None:
        """Why `auth` should be refreshed now (None: not now). `after_401`: upstream refused this
        token: a forced refresh, once per login: REFUSED_AGAIN when this token is the one a forced
        refresh gave (the caller takes the credential out; no refresh, no loop against the endpoint)."""
        if auth.kind != CHATGPT or not auth.refreshable:
            return None
        entry = self._accounts.setdefault(auth.account, _Account())
        if entry.token and entry.token != auth.fingerprint and entry.state not in IN_FLIGHT:
            self._go(entry, NEW_TOKEN)  # a new login or someone else's refresh: start afresh
            entry.failures = 0
        if entry.state in (*IN_FLIGHT, REFUSED):
            return None
        if after_401 and entry.fresh == auth.fingerprint:
            return REFUSED_AGAIN
        if entry.state in (WAITING, UNANSWERED) and now < entry.until:
            return None
        return AFTER_401 if after_401 else reason_due(auth, now)

    def start(self, auth: AuthMaterial, reason: str) -> None:
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, START)
        entry.token, entry.reason = auth.fingerprint, reason

    def done(self, auth: AuthMaterial, new: AuthMaterial) -> None:
        """Refreshed (by us, or found refreshed in the file): `new` is in force. After a 401's
        forced refresh, `new` is that login's last chance."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, DONE)
        entry.failures, entry.token = 0, new.fingerprint
        if entry.reason == AFTER_401:
            entry.fresh = new.fingerprint

    def unanswered(self, auth: AuthMaterial, now: float) -> float:
        """The exchange got no answer (it may have rotated the token at the endpoint): the seconds
        until the next try, which reads the file first (as after a transient failure)."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, NO_ANSWER)
        return self._backoff(entry, now)

    def reused(self, auth: AuthMaterial) -> float | None:
        """`refresh_token_reused` with the file unchanged: the seconds to wait before one more try
        (only right after an unanswered exchange), or None: the login is refused (`permanent`)."""
        entry = self._accounts.setdefault(auth.account, _Account())
        if entry.state != CHECKING:
            return None
        self._go(entry, REUSED_EVENT)
        return REUSED_WAIT

    def transient(self, auth: AuthMaterial, now: float) -> float:
        """A transient failure: the seconds until the next try."""
        entry = self._accounts.setdefault(auth.account, _Account())
        self._go(entry, TRANSIENT)
        return self._backoff(entry, now)

    def _backoff(self, entry: _Account, now: float) -> float:
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
        """Refused: no refresh of this login until its token changes (a new login)."""
        entry = self._accounts.setdefault(auth.account, _Account())
        if entry.state not in IN_FLIGHT:  # REFUSED_AGAIN is decided outside a refresh
            self._go(entry, START)
        self._go(entry, PERMANENT)
        entry.token = auth.fingerprint
