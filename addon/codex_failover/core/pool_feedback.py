"""What an attempt's outcome does to the pool: a rejection cools (or takes out) its credential, a
full rate-limit window cools it until the reset, a success restores it and homes the session.
Shared by the HTTP path and the WebSocket gate. Pure: clock injected through Health."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .affinity import Affinity
from .auth import AuthMaterial
from .client_boundary import RejectedKeys
from .cooldown_policy import held_out, over_cap
from .health import Health
from .policy import Policy
from .seen_clients import label
from .taxonomy import cooldown_seconds, hinted_seconds
from .usage import UsageBook, Window
from .vocabulary import ACCOUNT_DISABLED, AUTH_REJECTED, OVERLOAD_CLASSES, USAGE_WINDOW_FULL

log = logging.getLogger("codex_failover")


@dataclass
class PoolFeedback:
    health: Health
    affinity: Affinity
    usage: UsageBook
    rejected_keys: RejectedKeys | None = None
    pool_size: int = 1  # the pooled credentials (for the share held out for overload)
    pool_keys: frozenset[str] = frozenset()  # the pooled credentials' keys (empty: every key counts)

    def rejected(self, key: str, name: str, reason: str, status: int | None, error: dict[str, Any] | None,
                 retry_after: str | None, policy: Policy, where: str = "") -> None:
        if reason == AUTH_REJECTED:
            self.health.take_out(key, f"HTTP {status} from upstream; run `codex login` for this account")
            log.error("%scredential %s rejected with HTTP %s: taken out of rotation until its auth file or key "
                      "changes", where, name, status)
            return
        if reason == ACCOUNT_DISABLED:
            code = (error or {}).get("code") or (error or {}).get("type") or reason
            self.health.take_out(key, f"the account cannot use Codex ({code}); fix it, then run `codex login`")
            log.error("%scredential %s: its account cannot use Codex (%s, HTTP %s): taken out of rotation until "
                      "its auth file or key changes", where, name, code, status)
            return
        if reason in OVERLOAD_CLASSES:
            return self._overloaded(key, name, reason, error, retry_after, policy, where)
        seconds = cooldown_seconds(reason, error, retry_after, self.health.now(), policy)
        self.health.cool(key, seconds, reason)

    def _overloaded(self, key: str, name: str, reason: str, error: dict[str, Any] | None, retry_after: str | None,
                    policy: Policy, where: str) -> None:
        """Rest for the account's streak (or upstream's own time); past the share held out, the least
        recently failed overloaded accounts are back in rotation (cooldown_policy.py)."""
        now = self.health.now()
        rest = self.health.streaks.overloaded(key, now, policy.overload)
        hinted = hinted_seconds(error or {}, retry_after, now)
        self.health.cool(key, min(max(hinted if hinted is not None else rest, 1.0), policy.max_cooldown), reason)
        # Held out of the pool: its credentials only (a client's own key rests by its streak alone).
        held = [k for k in held_out(self.health.entries()) if not self.pool_keys or k in self.pool_keys]
        for back in over_cap(held, self.health.streaks, self.pool_size, policy.overload):
            self.health.restore(back)
            log.info("%scredential %s is back in rotation early: more than %g%% of the pool is resting for "
                     "overload", where, back, policy.overload.max_held_out * 100)

    def not_entitled(self, key: str, name: str, model: str | None, where: str = "") -> None:
        """The credential's plan lacks `model`: skipped for that model only, for a while
        (entitlement.py); it stays in rotation for every other model."""
        if self.health.models.not_entitled(key, model):
            log.info("%scredential %s is not entitled to model %s: skipped for it for %d min (still in rotation "
                     "for other models)", where, name, model, self.health.models.keep // 60)

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

    def succeeded(self, key: str, session: str | None, model: str | None = None) -> None:
        """No longer cooling (unless its usage window is full), and the session's new home; it serves
        `model` (entitlement.ModelBook.served)."""
        self.health.models.served(key, model)
        state = self.health.state(key)
        if state.status == "cooling" and state.reason != USAGE_WINDOW_FULL:
            self.health.restore(key)
        self.health.streaks.succeeded(key)  # its overload streak is over
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
