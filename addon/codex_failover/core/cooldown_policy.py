"""Overload cooldowns that do not cascade. Pure: time is passed in.

An account's overload comes in episodes, and a fixed long cooldown spills its load onto the others
until they trip too (docs/pool-file.md#overload-cooldowns). So:

- an overload (`OVERLOAD_CLASSES`) cools its account for `first` seconds; another one within
  `streak_window` of the account's previous overload continues its streak and cools it `factor` times
  longer, up to `max`; a success ends the streak (`OverloadStreaks`);
- at most `max_held_out` of the pool (at least one account) is held out for overload at once: past
  that, the least recently failed overloaded accounts are back in rotation (`over_cap`), so the next
  request tries one of them instead of answering "every credential is cooling"; their streaks stay,
  so a second failure rests them longer.

Usage limits, rate limits with a time and everything else keep their own cooldowns (taxonomy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from .units import parse_duration
from .vocabulary import OVERLOAD_CLASSES


class OverloadConfigError(ValueError):
    pass


@dataclass(frozen=True)
class OverloadPolicy:
    first: float = 15.0  # seconds an account rests after its first overload of a streak
    factor: float = 2.0  # each overload of the streak rests it this many times longer
    max: float = 900.0  # the longest overload rest
    streak_window: float = 600.0  # an overload within this of the account's previous one continues its streak
    max_held_out: float = 0.25  # share of the pooled credentials held out for overload at once (at least one)

    def cooldown(self, streak: int) -> float:
        return min(self.max, self.first * self.factor ** max(0, streak - 1))

    def cap(self, pool_size: int) -> int:
        return max(1, math.floor(self.max_held_out * max(1, pool_size) + 1e-9))


class OverloadStreaks:
    """Each account's current overload streak: how many overloads, the last one when."""

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[int, float]] = {}

    def overloaded(self, key: str, now: float, policy: OverloadPolicy) -> float:
        """Record an overload of `key` at `now`; how long it rests for it."""
        count, last = self._by_key.get(key, (0, -math.inf))
        count = count + 1 if now - last <= policy.streak_window else 1
        self._by_key[key] = (count, now)
        return policy.cooldown(count)

    def succeeded(self, key: str) -> None:
        self._by_key.pop(key, None)

    def streak(self, key: str) -> int:
        return self._by_key.get(key, (0, 0.0))[0]

    def last_failed(self, key: str) -> float:
        return self._by_key.get(key, (0, -math.inf))[1]


class ProbeClaims:
    """The credentials a request is probing through their overload rest now: one probe at a time each,
    so requests that arrive together while every credential rests do not all dial the same one. A
    claim lapses after `PROBE_CLAIM` seconds should its request never say how the probe ended."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def claim(self, key: str, now: float) -> bool:
        if self._until.get(key, -math.inf) > now:
            return False
        self._until[key] = now + PROBE_CLAIM
        return True

    def held(self, key: str, now: float) -> bool:
        return self._until.get(key, -math.inf) > now

    def release(self, key: str) -> None:
        self._until.pop(key, None)


PROBE_CLAIM = 60.0  # seconds: a probe's claim, at most (its request releases it when the probe ends)


def over_cap(held_out: Iterable[str], streaks: OverloadStreaks, pool_size: int, policy: OverloadPolicy) -> list[str]:
    """Of the accounts held out for overload now, those to bring back so that at most the policy's
    share stay out: the least recently failed first."""
    if policy.max_held_out >= 1.0:
        return []  # the whole pool may rest
    held = list(dict.fromkeys(held_out))
    extra = len(held) - policy.cap(pool_size)
    if extra <= 0:
        return []
    return sorted(held, key=streaks.last_failed)[:extra]


_FIELDS = {"first", "factor", "max", "streak_window", "max_held_out"}


def parse_overload(doc: object, where: str, policy_doc: object = None) -> OverloadPolicy:
    """The pool file's `overload:` section (absent: the defaults). A pool file written before this
    section existed sets `policy.overload_cooldown` (`policy_doc`): that is a streak's first rest,
    unless the section names `first`."""
    policy = _parse(doc, where)
    older = policy_doc.get("overload_cooldown") if isinstance(policy_doc, Mapping) else None
    if older is None or (isinstance(doc, Mapping) and "first" in doc):
        return policy
    try:
        first = parse_duration(older)
    except ValueError:
        return policy  # the policy section reports it
    return replace(policy, first=first, max=max(policy.max, first))


def _parse(doc: object, where: str) -> OverloadPolicy:
    if doc is None:
        return OverloadPolicy()
    if not isinstance(doc, Mapping):
        raise OverloadConfigError(f"{where}: expected a mapping, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise OverloadConfigError(f"{where}: unknown field(s) {', '.join(map(str, unknown))} "
                                  f"(allowed: {', '.join(sorted(_FIELDS))})")
    values: dict[str, float] = {}
    for key in ("first", "max", "streak_window"):
        if key in doc:
            try:
                values[key] = parse_duration(doc[key])
            except ValueError as exc:
                raise OverloadConfigError(f"{where}.{key}: {exc}") from None
            if values[key] <= 0 and key != "streak_window":
                raise OverloadConfigError(f"{where}.{key}: must be > 0")
    if "factor" in doc:
        factor = doc["factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 10:
            raise OverloadConfigError(f"{where}.factor: expected a number from 1 to 10, got {factor!r}")
        values["factor"] = float(factor)
    if "max_held_out" in doc:
        values["max_held_out"] = _share(doc["max_held_out"], f"{where}.max_held_out")
    policy = OverloadPolicy(**values)
    if policy.max < policy.first:
        raise OverloadConfigError(f"{where}.max: must be at least first ({policy.first:g}s)")
    return policy


def _share(value: object, where: str) -> float:
    """`25%` or a fraction (0.25); 0 < share <= 1."""
    text: Any = value.strip() if isinstance(value, str) else value  # float() says what it takes
    try:
        share = float(text[:-1]) / 100 if isinstance(text, str) and text.endswith("%") else float(text)
    except (TypeError, ValueError):
        raise OverloadConfigError(f"{where}: expected a share such as 25% or 0.25, got {value!r}") from None
    if isinstance(value, bool) or not 0 < share <= 1:
        raise OverloadConfigError(f"{where}: expected a share above 0% and at most 100%, got {value!r}")
    return share


def held_out(entries: Iterable[tuple[str, str, float | None, str]]) -> list[str]:
    """The keys cooling for an overload, from Health.entries()."""
    return [key for key, status, _until, reason in entries if status == "cooling" and reason in OVERLOAD_CLASSES]
