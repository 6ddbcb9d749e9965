"""When the pool can serve again, for the answers to "nothing can serve": the soonest recovery among
the credentials a request could use, the class of that cooldown, and the fields that tell Codex the
time. Pure: the health's clock (epoch seconds) is the only time it reads.

What Codex does with them (docs/architecture.md#what-codex-does-with-our-answers):
- a 429 whose error `type` is `usage_limit_reached` ends the turn and prints "try again at <time>"
  from `resets_at` (epoch seconds);
- a 503 whose code is `server_is_overloaded` is re-sent a few times, each after `Retry-After` when
  the header is there, then ends with "Selected model is at capacity". So `Retry-After` is sent only
  when it is true (a credential is back within `max_retry_after`): otherwise Codex gives up after its
  quick tries, seconds later, instead of sitting minutes through a promise nobody keeps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

from .health import COOLING, Health
from .vocabulary import USAGE_LIMIT_REASONS

# Cooldown reasons that are a usage limit (the account's own window), whose end is a reset time.


@dataclass(frozen=True)
class Soonest:
    """The first credential back: its cooldown's reason, in how many seconds, at which epoch time."""

    reason: str | None
    seconds: float
    at: float
    usage_at: float | None = None  # the soonest usage-limit reset among them, if any

    @property
    def usage_limit(self) -> bool:
        return self.reason in USAGE_LIMIT_REASONS


def soonest(health: Health, keys: Iterable[str]) -> Soonest | None:
    """The soonest recovery among `keys` that are cooling (None: none is; out of rotation never
    comes back by itself)."""
    now = health.now()
    best: tuple[float, str | None] | None = None
    usage_at: float | None = None
    for key in dict.fromkeys(keys):
        state = health.state(key)
        if state.status != COOLING or state.until is None:
            continue
        if best is None or state.until < best[0]:
            best = (state.until, state.reason)
        if state.reason in USAGE_LIMIT_REASONS and (usage_at is None or state.until < usage_at):
            usage_at = state.until
    if best is None:
        return None
    return Soonest(best[1], max(0.0, best[0] - now), best[0], usage_at)


def time_fields(found: Soonest | None, usage_limit: bool) -> dict[str, Any]:
    """The error-body fields that tell the time: `resets_at` / `resets_in_seconds` for a usage limit
    (the soonest usage reset), `retry_after_seconds` for the soonest recovery of any kind."""
    if found is None:
        return {}
    out = {"retry_after_seconds": math.ceil(found.seconds)}
    at = found.usage_at if usage_limit else None
    if at is not None:
        out["resets_at"] = math.ceil(at)
        out["resets_in_seconds"] = max(0, math.ceil(at - (found.at - found.seconds)))
    return out


def back_in(found: Soonest | None) -> str:
    """The sentence a message ends with: when the first credential is back."""
    if found is None:
        return "No credential is cooling down: none will come back by itself."
    when = time.strftime("%H:%M:%S UTC", time.gmtime(found.at))
    return f"The first credential is back in {_span(found.seconds)} (at {when})."


def _span(seconds: float) -> str:
    seconds = math.ceil(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 60)} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def retry_after(waits: Iterable[float | None], cap: float) -> int | None:
    """Seconds for a Retry-After header from each credential's wait until it is ready (0: ready now,
    None: out of rotation): only a true promise, the first back within `cap`; None (no header)
    otherwise, or when the cap is 0."""
    known = [w for w in waits if w is not None]
    if cap <= 0 or not known or min(known) > cap:
        return None
    return max(1, math.ceil(min(known)))
