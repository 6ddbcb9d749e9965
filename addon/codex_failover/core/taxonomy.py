"""What a synchronous upstream answer means, how long a rejection cools a credential, and which
status an exhausted request gets. Pure: the strings themselves live in the rules file."""

from __future__ import annotations

import email.utils
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, TypeGuard

from .policy import Policy
from .rules import Rules
from .vocabulary import (
    AUTH_REJECTED,
    CAPACITY,
    CLIENT_ERROR,
    CLOSED_BEFORE_OUTPUT,
    EDGE_BLOCKED,
    FORBIDDEN_PAGE,
    HOST_NETWORK,
    MODEL_NOT_ENTITLED,
    OK,
    PRE_DISPATCH,
    RATE_LIMITED,
    ROUTE_DOWN,
    STALLED_BEFORE_OUTPUT,
    STATE_LOST,
    UPSTREAM_5XX,
    USAGE_LIMIT,
    USAGE_WINDOW_FULL,
    WORKSPACE_LIMIT,
    Verdict,
)

# Classes that never cool their credential (cooldown_seconds is 0 for them): they say nothing about the
# account. Every other class cools for upstream's own time, else the policy's overload_cooldown.
_NO_COOLDOWN = {CLOSED_BEFORE_OUTPUT, STALLED_BEFORE_OUTPUT, UPSTREAM_5XX, AUTH_REJECTED, PRE_DISPATCH, ROUTE_DOWN,
                HOST_NETWORK, EDGE_BLOCKED, FORBIDDEN_PAGE, MODEL_NOT_ENTITLED, STATE_LOST}
# A workspace spend cap says no time: the account rests this long (the usage endpoint cannot tell
# when an admin raises the cap, so it is not re-checked there), unless upstream names one.
WORKSPACE_REST = 6 * 3600.0
# Status for an exhausted request, by the class of the rejection that decided it. Codex treats
# 429 as final for the turn and re-sends a 503 four times (docs/architecture.md#what-codex-does-with-our-answers).
_EXHAUSTED_STATUS = {USAGE_LIMIT: 429, USAGE_WINDOW_FULL: 429, CAPACITY: 429, RATE_LIMITED: 429, WORKSPACE_LIMIT: 429,
                     PRE_DISPATCH: 502, ROUTE_DOWN: 502, HOST_NETWORK: 502, EDGE_BLOCKED: 502,
                     FORBIDDEN_PAGE: 502, MODEL_NOT_ENTITLED: 400}
_PAGE_TEXT = 16384  # how much of a page that is no JSON error is matched (an edge's block page says it late)
_TRY_AGAIN = re.compile(r"try again in (\d+(?:\.\d+)?)\s*(ms|s)\b", re.IGNORECASE)


@dataclass(frozen=True)
class ResponseVerdict:
    verdict: Verdict  # COMMIT (stream it), FAILOVER, DELIVER (answer the client with it as is)
    reason: str
    error: Mapping[str, Any] | None = None


def error_object(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-style JSON error body ({} when there is none)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    inner = doc.get("error")
    if isinstance(inner, dict):
        return dict(inner)
    if isinstance(inner, str):
        return {"message": inner}
    detail = doc.get("detail")  # the ChatGPT backend's own shape: {"detail": {"code": ...}} or {"detail": "text"}
    if isinstance(detail, dict):
        return {k: detail[k] for k in ("code", "type", "message", "param") if k in detail}
    if isinstance(detail, str):
        return {"message": detail}
    return {k: doc[k] for k in ("code", "type", "message", "param") if k in doc}


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def classify_response(status: int, body: bytes, rules: Rules, headers: Mapping[str, str] | None = None) -> ResponseVerdict:
    """A synchronous answer (headers and complete body known, not an event stream). `headers`: the
    answer's, by lower-case name (`answer_headers`). A 401, or a 403 JSON error, that names no rejection
    is the credential's: AUTH_REJECTED (a 403 that is no JSON error is the rules' `forbidden_page`)."""
    if 200 <= status < 300:
        return ResponseVerdict(Verdict.COMMIT, OK)
    error = error_object(body)
    plain = not error and not _is_json(body)
    # A page that is no JSON error (a gateway's): its text is matched as the message, never kept.
    message = body[:_PAGE_TEXT].decode("utf-8", "replace") if plain else error.get("message")
    error.setdefault("status", status)
    klass = rules.rejection_class(error.get("code"), error.get("type"), message, status, plain_text=plain,
                                  param=error.get("param"), headers=headers)
    if klass:
        return ResponseVerdict(Verdict.FAILOVER, klass, error)
    if status in (401, 403):
        return ResponseVerdict(Verdict.FAILOVER, AUTH_REJECTED, error)
    if status >= 500:
        return ResponseVerdict(Verdict.FAILOVER, UPSTREAM_5XX, error)
    return ResponseVerdict(Verdict.DELIVER, CLIENT_ERROR, error)


def answer_headers(headers: object) -> dict[str, str]:
    """An answer's headers by lower-case name, from a mapping or (name, value) byte pairs."""
    items = headers.items() if isinstance(headers, Mapping) else headers if isinstance(headers, (list, tuple)) else ()
    out: dict[str, str] = {}
    for name, value in items:
        key = name.decode("latin-1") if isinstance(name, bytes) else str(name)
        out[key.lower()] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return out


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """`Retry-After` as seconds or as an HTTP-date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


def cooldown_seconds(reason: str, error: Mapping[str, Any] | None, retry_after: str | None, now: float, policy: Policy) -> float:
    """How long a rejection of class `reason` cools its credential (0: not at all)."""
    if reason in _NO_COOLDOWN:
        return 0.0
    hinted = hinted_seconds(error or {}, retry_after, now)
    seconds = hinted if hinted is not None else WORKSPACE_REST if reason == WORKSPACE_LIMIT else policy.overload_cooldown
    return min(max(seconds, 1.0), policy.max_cooldown)


def hinted_seconds(error: Mapping[str, Any], retry_after: str | None, now: float) -> float | None:
    """When upstream says to come back: Retry-After, resets_in_seconds, resets_at, "try again in"."""
    header = retry_after_seconds(retry_after, now)
    if header is not None:
        return header
    resets_in = error.get("resets_in_seconds")
    if _number(resets_in):
        return float(resets_in)
    resets_at = error.get("resets_at")
    if _number(resets_at):
        at = float(resets_at)
        if at > 1e11:  # milliseconds since the epoch
            at /= 1000.0
        return max(0.0, at - now)
    message = error.get("message")
    if isinstance(message, str) and (m := _TRY_AGAIN.search(message)):
        value = float(m.group(1))
        return value / 1000.0 if m.group(2).lower() == "ms" else value
    return None


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def exhausted_status(reason: str | None) -> int:
    return _EXHAUSTED_STATUS.get(reason or "", 503)
