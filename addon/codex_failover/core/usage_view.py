"""What Codex is told about its limits (`GET …/wham/usage`, `…/api/codex/usage`) when its own account
is limited and the pool can serve its next turn. Pure: the clock is injected.

Codex (since 0.154) shows `/status` and its limit warnings from this answer, and blocks sending when
the signed-in account is at its limit, though the proxy would serve the turn from the pool. So:

- the own account can send (its answer is 2xx and says it may, and the pool has it in rotation): its
  answer passes as it is;
- otherwise the answer is the usage of the credential the next turn would be placed on, asked with
  that credential's own token: the fields Codex reads (its plan, `rate_limit`: allowed, limit_reached,
  both windows; credits), never its identity; no number of one account is mixed with another's. It says so twice: a top-level
  `codex_failover` object (`served_by`, and the own account's state) and, where Codex lists extra
  limits on `/status`, an entry named `pool: NAME` carrying the same windows.

A Business account under spend controls answers `"rate_limit": null` and a `spend_control` block: its
limit is read from that block (cooldown_end.usage_has_headroom), and its answer passes whole, with no
`pool:` entry (it has no windows to repeat).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Mapping

from .cooldown_end import usage_has_headroom

USAGE_PATHS = ("/wham/usage", "/api/codex/usage")
# What Codex reads of the answer (its RateLimitStatusPayload): a pooled account's answer carries these
# only, never its identity (user id, account id, email).
CODEX_FIELDS = ("plan_type", "rate_limit", "credits", "additional_rate_limits", "rate_limit_reached_type",
                "spend_control")  # a Business account's limits when its rate_limit is null (no identity in it)


def is_usage_request(method: str, path: str) -> bool:
    return method.upper() == "GET" and path.split("?")[0].rstrip("/").endswith(USAGE_PATHS)


def own_can_send(status: int, doc: object, own_ready: bool) -> bool:
    """The own account's answer stands: it is an answer, it does not say the limit is reached, and
    the pool has the account in rotation."""
    return 200 <= status < 300 and own_ready and usage_has_headroom(doc) is not False


def pooled_view(doc: Mapping[str, Any], name: str, own_status: int) -> dict[str, Any]:
    """The pooled credential `name`'s usage answer, the fields Codex reads only, saying whose it is."""
    out = {key: copy.deepcopy(doc[key]) for key in CODEX_FIELDS if key in doc}
    out["codex_failover"] = {"served_by": name, "own_account": "limited" if 200 <= own_status < 300 else
                             f"no answer (HTTP {own_status})",
                             "note": f"the numbers are credential {name}'s: the next turn goes to it"}
    limit = out.get("rate_limit")
    if isinstance(limit, Mapping):
        extra = out.get("additional_rate_limits")
        extra = list(extra) if isinstance(extra, list) else []
        extra.insert(0, {"limit_name": f"pool: {name}", "metered_feature": "codex_failover_pool",
                         "rate_limit": copy.deepcopy(dict(limit))})
        out["additional_rate_limits"] = extra
    return out


class UsageCache:
    """Each pooled credential's last usage answer, for `ttl` seconds (Codex asks often)."""

    def __init__(self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.ttl, self._clock = ttl, clock
        self._by_key: dict[str, tuple[float, dict[str, Any]]] = {}

    def get(self, key: str) -> dict[str, Any] | None:
        hit = self._by_key.get(key)
        if hit is None or self._clock() - hit[0] > self.ttl:
            return None
        return hit[1]

    def put(self, key: str, doc: dict[str, Any]) -> None:
        self._by_key[key] = (self._clock(), doc)
