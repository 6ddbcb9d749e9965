"""Cooldowns that end when the account is back, before their time: a redeemed reset credit, a usage
endpoint that says the window reset early, or a user's word. Pure: no I/O, the clock is Health's.

- `redeems_reset_credit`: Codex's `POST …/wham/rate-limit-reset-credits/consume` answered 2xx (the
  account used one of its reset credits: its usage windows start again);
- `UsageRecheck`: which usage-limit cooldowns to re-check through the account's own usage endpoint
  (`GET …/wham/usage`, no model request), at most one check per credential per `every` seconds and
  only for cooldowns that have longer than that to run;
- `usage_has_headroom`: what a usage answer says (Codex's own fields: `rate_limit.allowed`,
  `limit_reached`, `primary_window` / `secondary_window` with `used_percent`);
- `CooldownEnds`: ends a cooldown (or an out-of-rotation mark) and remembers how and when, for the
  status page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .health import COOLING, OUT, Health
from .usage import Window, finite_number, spend_control
from .vocabulary import USAGE_LIMIT_REASONS

CONSUME_PATH = "/wham/rate-limit-reset-credits/consume"

# How a cooldown ended (the status page and the log line say it).
REDEEMED = "reset credit redeemed"
RECHECKED = "usage endpoint reports headroom"
BY_HAND = "ended by hand"


def redeems_reset_credit(method: str, path: str, status: int) -> bool:
    return method.upper() == "POST" and path.split("?")[0].rstrip("/").endswith(CONSUME_PATH) and 200 <= status < 300


def usage_url(base_url: str) -> str:
    """The account's usage endpoint, as Codex derives it from its base URL: ChatGPT's backend
    (`…/backend-api`) serves `/wham/usage`, any other `/api/codex/usage`."""
    base = base_url.rstrip("/").removesuffix("/codex")
    return base + ("/wham/usage" if "/backend-api" in base else "/api/codex/usage")


def usage_windows(doc: object) -> list[Window]:
    """The windows of a usage answer (`rate_limit.primary_window` / `secondary_window`, and a
    `spend_control.individual_limit`); tolerant of `"rate_limit": null` (Business accounts)."""
    limit = doc.get("rate_limit") if isinstance(doc, Mapping) else None
    out = []
    if isinstance(limit, Mapping):
        for name in ("primary", "secondary"):
            window = limit.get(f"{name}_window")
            if isinstance(window, Mapping) and (used := finite_number(window.get("used_percent"))) is not None:
                out.append(Window(name, used, finite_number(window.get("reset_at"))))
    spend = spend_control(doc)[1]
    return out + ([spend] if spend is not None else [])


def usage_has_headroom(doc: object, full_at: float = 100.0) -> bool | None:
    """True: the account may send again; False: still limited; None: the answer says nothing. A
    spend control that is `reached` (or whose individual limit is full) is a limit too."""
    limit = doc.get("rate_limit") if isinstance(doc, Mapping) else None
    reached, _ = spend_control(doc)
    if reached is True:
        return False
    if isinstance(limit, Mapping) and (limit.get("allowed") is False or limit.get("limit_reached") is True):
        return False
    windows = usage_windows(doc)
    if any(w.used_percent >= full_at for w in windows):
        return False
    if isinstance(limit, Mapping) and (limit.get("allowed") is True or limit.get("limit_reached") is False):
        return True
    return True if windows or reached is False else None


@dataclass
class UsageRecheck:
    every: float = 300.0  # seconds between two checks of one credential; 0: never check

    def __post_init__(self) -> None:
        self._checked: dict[str, float] = {}

    def due(self, health: Health, keys: Iterable[str]) -> list[str]:
        """The credentials to check now: cooling for a usage limit, with more than `every` to go,
        not checked in the last `every` seconds."""
        if self.every <= 0:
            return []
        now = health.now()
        out = []
        for key in keys:
            state = health.state(key)
            if state.status != COOLING or state.reason not in USAGE_LIMIT_REASONS or state.until is None \
                    or state.until - now <= self.every:
                continue
            if now - self._checked.get(key, float("-inf")) >= self.every:
                out.append(key)
        return out

    def checked(self, key: str, now: float) -> None:
        self._checked[key] = now


@dataclass(frozen=True)
class Ended:
    how: str
    at: float  # epoch seconds
    was: str  # the reason it was cooling (or out) for


class CooldownEnds:
    def __init__(self) -> None:
        self.last: dict[str, Ended] = {}  # health key -> how its last cooldown ended early

    def end(self, health: Health, key: str, how: str, usage_only: bool = False) -> Ended | None:
        """End `key`'s cooldown (or out-of-rotation mark); None when there was none (or, with
        `usage_only`, when it is cooling for something else than a usage limit)."""
        state = health.state(key)
        if state.status not in (COOLING, OUT):
            return None
        if usage_only and (state.status != COOLING or state.reason not in USAGE_LIMIT_REASONS):
            return None
        health.restore(key)
        ended = Ended(how, health.now(), state.reason or state.status)
        self.last[key] = ended
        return ended
