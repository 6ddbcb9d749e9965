"""What an attempt's outcome does to the pool: a rejection cools (or takes out) its credential, a
full rate-limit window cools it until the reset, a success restores it and homes the session.
Shared by the HTTP path and the WebSocket gate. Pure: clock injected through Health."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .affinity import Affinity
from .auth import AuthMaterial
from .client_boundary import RejectedKeys
from ..config import Policy
from .health import Health
from .seen_clients import label
from .taxonomy import AUTH_REJECTED, cooldown_seconds
from .usage import UsageBook, Window

log = logging.getLogger("codex_failover")
USAGE_WINDOW_FULL = "usage_window_full"


@dataclass
class PoolFeedback:
    health: Health
    affinity: Affinity
    usage: UsageBook
    rejected_keys: RejectedKeys | None = None

    def rejected(self, key: str, name: str, reason: str, status: int | None, error: dict | None,
                 retry_after: str | None, policy: Policy, where: str = "") -> None:
        if reason == AUTH_REJECTED:
            self.health.take_out(key, f"HTTP {status} from upstream; run `codex login` for this account")
            log.error("%scredential %s rejected with HTTP %s: taken out of rotation until its auth file or key "
                      "changes", where, name, status)
            return
        seconds = cooldown_seconds(reason, error, retry_after, self.health.now(), policy)
        self.health.cool(key, seconds, reason)

    def usage_seen(self, key: str, name: str, windows: list[Window], policy: Policy, where: str = "",
                   full_at: float = 100.0) -> None:
        """A rate-limit window at 100% (or the credential's `max_usage_percent`) cools the
        credential until that window resets."""
        until = self.usage.record(key, windows, full_at)
        now = self.health.now()
        if until is not None and until > now:
            self.health.cool(key, min(until - now, policy.max_cooldown), USAGE_WINDOW_FULL)
            log.info("%scredential %s: a rate-limit window is %s; cooling until it resets", where, name,
                     "full" if full_at >= 100 else f"at or over its max_usage_percent ({full_at:g}%)")

    def succeeded(self, key: str, session: str | None) -> None:
        """No longer cooling (unless its usage window is full), and the session's new home."""
        state = self.health.state(key)
        if state.status == "cooling" and state.reason != USAGE_WINDOW_FULL:
            self.health.restore(key)
        self.affinity.set(session, key)

    def client_refused(self, auth: AuthMaterial | None) -> None:
        """The upstream refused the client's own credential (401/403): it is never lent the pool while
        remembered (client_boundary.RejectedKeys, by fingerprint)."""
        if self.rejected_keys is None or auth is None:
            return
        if auth.fingerprint not in self.rejected_keys:
            log.info("client credential %s was refused by the upstream: not lent the pool for %d min (its "
                     "requests pass through on their own)", label(auth), self.rejected_keys.keep // 60)
        self.rejected_keys.refused(auth.fingerprint)
