"""When each pooled ChatGPT credential's access token expires, and the command that refreshes it.

The proxy refreshes pooled logins itself (core/token_refresh.py, on by default): then this module
only says when each token ends. With `failover_token_refresh` off, or for a login without a refresh
token, a spare that only the pool uses runs out; without warning that shows at the first request
that skips it. So this module says it ahead of time: at start-up one line per ChatGPT spare (when it
expires and how to refresh it), and later one warning per token once it is under WARN_WITHIN of its
end; the status page carries the same facts. Pure: the clock is passed in.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any, Iterable

from .auth import CHATGPT
from .policy import Credential

WARN_WITHIN = 24 * 3600.0  # seconds before `exp` a token is worth a warning


def refresh_command(cred: Credential) -> str:
    """`CODEX_HOME=<folder of its auth.json> codex login`: `codex login` writes the auth.json of
    the folder CODEX_HOME names (~/.codex when unset)."""
    return login_command(cred.auth_file)


def login_command(auth_file: str | None) -> str:
    """The command that writes `auth_file` anew (see refresh_command)."""
    if not auth_file:
        return "codex login (for that account)"
    folder = str(Path(auth_file).expanduser().parent)
    rest = folder[len(str(Path.home())) + 1:] if folder.startswith(str(Path.home()) + "/") else None
    shown = f"~/{rest}" if rest and shlex.quote(rest) == rest else shlex.quote(folder)  # ~ expands after =
    return f"CODEX_HOME={shown} codex login"


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))


def left(seconds: float) -> str:
    """A duration as people read it: 3.2 days, 5.1 h, 12 min."""
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{max(seconds, 0) / 60:.0f} min"


def describe(cred: Credential, now: float) -> dict[str, Any] | None:
    """The status page's fields for a ChatGPT credential whose token has an `exp`; else None."""
    at = cred.auth.expires_at
    if cred.kind != CHATGPT or at is None:
        return None
    return {"token_expires_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at)),
            "token_expires_in_s": round(at - now), "refresh": refresh_command(cred)}


def line(cred: Credential, now: float, auto: bool = False) -> tuple[bool, str] | None:
    """(a warning?, the line) for a ChatGPT credential's token: expired, expiring within
    WARN_WITHIN, or fine; None when it has no `exp`. `auto`: the proxy refreshes tokens itself
    (failover_token_refresh), so a login with a refresh token needs nothing from the user."""
    at = cred.auth.expires_at
    if cred.kind != CHATGPT or at is None:
        return None
    remaining = at - now
    if auto and cred.auth.refreshable:
        if remaining <= 0:
            return True, (f"credential {cred.name}: its ChatGPT access token expired at {_when(at)}; it is skipped "
                          f"until the proxy has refreshed it (if that fails: {refresh_command(cred)})")
        return False, (f"credential {cred.name}: ChatGPT access token expires at {_when(at)}, in {left(remaining)}; "
                       "the proxy refreshes it (after 8 days, or a day before its end)")
    if remaining <= 0:
        return True, (f"credential {cred.name}: its ChatGPT access token expired at {_when(at)}; it is skipped until "
                      f"refreshed: {refresh_command(cred)}")
    state = f"expires at {_when(at)}, in {left(remaining)}"
    if remaining <= WARN_WITHIN:
        return True, f"credential {cred.name}: its ChatGPT access token {state}; refresh it now: {refresh_command(cred)}"
    return False, f"credential {cred.name}: ChatGPT access token {state} (refresh: {refresh_command(cred)})"


class ExpiryWatch:
    """One warning per token as it comes within WARN_WITHIN of its end (or past it) while the proxy
    runs; tokens already reported at start-up are not reported again."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, float]] = set()
        self.auto = False  # the proxy refreshes tokens itself (failover_token_refresh)

    def at_start(self, creds: Iterable[Credential], now: float) -> list[tuple[bool, str]]:
        out = []
        for cred in creds:
            found = line(cred, now, self.auto)
            if found is not None:
                out.append(found)
                if found[0] and cred.auth.expires_at is not None:  # (found: it has an `exp`)
                    self._warned.add((cred.name, cred.auth.expires_at))
        return out

    def check(self, creds: Iterable[Credential], now: float) -> list[str]:
        """Warnings that are new since the last call."""
        out = []
        for cred in creds:
            at = cred.auth.expires_at
            if cred.kind != CHATGPT or at is None or at - now > WARN_WITHIN or (cred.name, at) in self._warned \
                    or (self.auto and cred.auth.refreshable):
                continue
            self._warned.add((cred.name, at))
            found = line(cred, now)  # never None here: a ChatGPT credential with an `exp`
            if found is not None:
                out.append(found[1])
        return out
