"""Answers the addon gives the client itself: always a real status with an OpenAI-shaped JSON
error body (`{"error": {"type", "code", "message", ...}}`), never a secret in it."""

from __future__ import annotations

import json
import time

from mitmproxy import http

from ..core.planner import NOT_ENTITLED
from ..core.pool_wait import Soonest, back_in, time_fields
from ..core.taxonomy import exhausted_status
from ..core.vocabulary import (
    AUTH_REJECTED,
    CAPACITY,
    EDGE_BLOCKED,
    FORBIDDEN_PAGE,
    HOST_NETWORK,
    MODEL_NOT_ENTITLED,
    NO_USABLE_CREDENTIAL,
    OVERLOADED,
    PRE_DISPATCH,
    RATE_LIMITED,
    ROUTE_DOWN,
    SERVER_ERROR_RETRYABLE,
    SLOW_DOWN,
    USAGE_LIMIT,
    USAGE_LIMIT_REASONS,
    USAGE_WINDOW_FULL,
    WORKSPACE_LIMIT,
)
from ..net.relay import HOP_BY_HOP
from .secret_guard import SECRETS

# Error type and code by rejection class, when upstream's own error object has none.
_DEFAULTS = {
    OVERLOADED: ("service_unavailable_error", "server_is_overloaded"),
    SLOW_DOWN: ("service_unavailable_error", "slow_down"),
    CAPACITY: ("service_unavailable_error", "model_at_capacity"),
    RATE_LIMITED: ("rate_limit_error", "rate_limit_exceeded"),
    USAGE_LIMIT: ("usage_limit_reached", "usage_limit_reached"),
    USAGE_WINDOW_FULL: ("usage_limit_reached", "usage_limit_reached"),
    SERVER_ERROR_RETRYABLE: ("server_error", "server_error"),
    PRE_DISPATCH: ("upstream_error", "upstream_connect_failed"),
    ROUTE_DOWN: ("upstream_error", "route_down"),
    HOST_NETWORK: ("upstream_error", "network_unreachable"),
    WORKSPACE_LIMIT: ("usage_limit_reached", "usage_limit_reached"),
    EDGE_BLOCKED: ("upstream_error", "edge_blocked"),
    FORBIDDEN_PAGE: ("upstream_error", "forbidden"),
    MODEL_NOT_ENTITLED: ("invalid_request_error", "model_not_found"),
}
_KEEP = ("type", "code", "message", "param", "resets_at", "resets_in_seconds", "plan_type")


def _retry_after(seconds: int | None) -> dict[str, str]:
    return {} if seconds is None else {"retry-after": str(seconds)}


def json_error(status: int, error: dict, headers: dict[str, str] | None = None) -> http.Response:
    # Upstream text quoted here (a pooled credential's error message) may echo a key: masked.
    body = json.dumps({"error": SECRETS.mask_in(error)}, indent=None).encode()
    all_headers = {"content-type": "application/json", "x-codex-failover": "1", **(headers or {})}
    return http.Response.make(status, body, all_headers)


def _answer_class(reason: str | None, first: Soonest | None) -> str | None:
    """The class an answer for "nothing can serve" speaks for: the cooldown that ends first (the
    user's next chance), else the rejection that decided."""
    return first.reason if first is not None and first.reason in _DEFAULTS else reason


def _tell_the_time(error: dict, klass: str | None, first: Soonest | None) -> None:
    """The soonest recovery the pool knows, in the fields Codex reads and in the message."""
    usage = klass in USAGE_LIMIT_REASONS
    error.update(time_fields(first, usage))
    error["message"] = f"{error['message']} {back_in(first)}"


def exhausted(last, history, retry_after: int | None, pinned: str | None = None,
              first: Soonest | None = None) -> http.Response:
    """Every attempt was rejected. The status follows the rejection that decided it, or the cooldown
    that ends first (with the time it ends)."""
    attempts = [h.as_dict() for h in history]
    real = [h for h in history if h.reason != AUTH_REJECTED]
    if last is None or last.reason == AUTH_REJECTED and not real:
        error: dict[str, object] = {"type": "service_unavailable_error", "code": NO_USABLE_CREDENTIAL,
                 "message": "codex-failover: no credential could serve this request (see attempts)."}
        status = 503
    else:
        klass = _answer_class(last.reason, first)
        upstream = {k: v for k, v in (last.error or {}).items() if k in _KEEP and v is not None}
        kind, code = _DEFAULTS.get(last.reason, ("service_unavailable_error", last.reason))
        if klass is not None and klass != last.reason:  # the answer speaks for another cooldown: upstream's fields are not its own
            (kind, code), upstream = _DEFAULTS[klass], {k: v for k, v in upstream.items() if k == "message"}
        error = {"type": kind, "code": code, **upstream}  # (then its attempts)
        error["message"] = (f"{upstream.get('message') or 'Upstream rejected the request.'} "
                            f"(codex-failover: {len(history)} attempt(s), last rejection: {last.reason})")
        _tell_the_time(error, klass, first)
        status = exhausted_status(klass)
    error["attempts"] = attempts
    if pinned:
        error["not_moved_because"] = pinned
    return json_error(status, error, _retry_after(retry_after))


def all_cooling(skipped, retry_after: int | None, pinned: str | None = None,
                first: Soonest | None = None) -> http.Response:
    """Every credential is cooling or out of rotation: answered at once, nothing dialled. The status
    and the time are those of the cooldown that ends first."""
    if skipped and all(status == NOT_ENTITLED for _, status, _ in skipped):
        error = {"type": "invalid_request_error", "code": MODEL_NOT_ENTITLED, "param": "model",
                 "message": "codex-failover: no credential of this pool is entitled to this model (each said so "
                            "lately); not dialled.",
                 "credentials": [{"credential": name, "state": status} for name, status, _ in skipped]}
        return json_error(exhausted_status(MODEL_NOT_ENTITLED), error)
    reasons = [r for _, status, r in skipped if status == "cooling"]
    reason = _answer_class(reasons[0] if reasons else None, first)
    kind, code = _DEFAULTS.get(reason or "", ("service_unavailable_error", NO_USABLE_CREDENTIAL))
    error = {
        "type": kind,
        "code": code,
        "message": "codex-failover: every credential is cooling down or out of rotation; not dialled.",
        "credentials": [{"credential": name, "state": status, "reason": why} for name, status, why in skipped],
    }
    _tell_the_time(error, reason, first)
    if pinned:
        error["not_moved_because"] = pinned
    return json_error(exhausted_status(reason or ""), error, _retry_after(retry_after))


def no_pool_credential(why: str) -> http.Response:
    """Pool-only mode, and no pooled credential can serve this kind of request (core/pool_reach.py)."""
    error = {"type": "service_unavailable_error", "code": "no_pool_credential_for_request",
             "message": f"codex-failover: {why}; not dialled."}
    return json_error(503, error)


def upstream_failed(message: str, history) -> http.Response:
    """A failure that must not be replayed (or nothing else could serve): the real reason."""
    error = {"type": "upstream_error", "code": "upstream_connection_failed",
             "message": f"codex-failover: {message}", "attempts": [h.as_dict() for h in history]}
    return json_error(502, error)


def recovery_exhausted(why: str, history) -> http.Response:
    """Recovery ran out on a stream that never ended properly: request-scoped, nothing cools."""
    error = {"type": "timeout_error", "code": "stream_incomplete",
             "message": f"codex-failover: the upstream stream ended without completing ({why}), on every retry.",
             "attempts": [h.as_dict() for h in history]}
    return json_error(408, error)


def websocket_downgrade(why: str = "failover_websocket=downgrade") -> http.Response:
    """426 makes Codex switch the session to HTTP POST + SSE at once (docs/architecture.md#what-codex-does-with-our-answers)."""
    error = {"type": "invalid_request_error", "code": "websocket_not_supported",
             "message": f"codex-failover: use HTTP/SSE for model requests ({why})."}
    return json_error(426, error)


def internal_error(message: str) -> http.Response:
    error = {"type": "server_error", "code": "codex_failover_internal_error",
             "message": f"codex-failover internal error: {message}"}
    return json_error(502, error)


def client_not_allowed() -> http.Response:
    """A client that may not use the pool (not loopback, not in failover_clients): nothing is sent
    upstream for it, and it learns nothing about the pool."""
    error = {"type": "permission_error", "code": "client_not_allowed",
             "message": "codex-failover: this proxy's credential pool serves only its own machine; "
                        "its operator can allow more clients with --set failover_clients=ADDR/CIDR,..."}
    return json_error(403, error)


def client_response(status: int, reason: str, headers: list[tuple[bytes, bytes]]) -> http.Response:
    """The head of the winner's answer to a held client: its headers without hop-by-hop ones,
    chunked (what an HTTP/1.1 client reads; HTTP/2 drops it)."""
    fields = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
    fields.append((b"transfer-encoding", b"chunked"))
    return http.Response(b"HTTP/1.1", status, (reason or "OK").encode(), http.Headers(fields), None, None,
                         time.time(), None)
