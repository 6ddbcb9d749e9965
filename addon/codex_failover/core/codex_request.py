"""Recognising Codex model requests and moving one to another credential. Pure (no mitmproxy):
headers are anything with `keys`, `get`, `__setitem__`, `__delitem__` and `__contains__`
(mitmproxy's `Headers`, or a plain dict in tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, MutableMapping
from urllib.parse import urlsplit

from .auth import AuthMaterial
from .replay_safety import ATTESTATION

# Default endpoints; configured base URLs add to these.
KNOWN_BASE_URLS = ("https://chatgpt.com/backend-api/codex", "https://api.openai.com/v1")
RESPONSES = "/responses"
COMPACT = "/responses/compact"  # the older remote compaction endpoint: a JSON answer, not a stream
_AUTH_HEADERS = ("authorization", "chatgpt-account-id", "x-openai-fedramp")
TURN_STATE = "x-codex-turn-state"
# Headers that scope a request to the client's account, besides the credential itself: Codex sends
# OpenAI-Organization / OpenAI-Project (API-key mode, from $OPENAI_ORGANIZATION / $OPENAI_PROJECT)
# and echoes x-codex-turn-state (issued by the account that served the turn); the Desktop app and the
# IDE extension send x-oai-attestation (their device's attestation for the signed-in account's request:
# replay_safety.py). None of them belongs on another credential's attempt.
ACCOUNT_SCOPED = ("openai-organization", "openai-project", TURN_STATE, ATTESTATION)


@dataclass(frozen=True)
class ModelEndpoint:
    scheme: str
    host: str
    port: int
    path: str  # the base URL's path + /responses

    @classmethod
    def from_base_url(cls, base_url: str) -> "ModelEndpoint":
        parts = urlsplit(base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/") + RESPONSES)


class EndpointMatcher:
    """Is (host, port, path) a model endpoint? A set lookup: cheap for all other traffic."""

    def __init__(self, base_urls: Iterable[str] = ()):
        endpoints = {ModelEndpoint.from_base_url(u) for u in (*KNOWN_BASE_URLS, *base_urls)}
        self._keys = {(e.host, e.port, e.path) for e in endpoints}
        self._keys |= {(host, port, path + COMPACT.removeprefix(RESPONSES)) for host, port, path in self._keys}
        self._hosts = {(host, port) for host, port, _ in self._keys}

    def is_model_host(self, host: str, port: int) -> bool:
        """A known model host, or the host of one of the pool's base URLs (its port too)."""
        return (host.lower(), port) in self._hosts

    def matches(self, host: str, port: int, path: str) -> bool:
        if not path.endswith((RESPONSES, COMPACT)) and "?" not in path:
            return False
        return (host.lower(), port, path.split("?", 1)[0]) in self._keys


def is_compact(path: str) -> bool:
    """A `POST …/responses/compact`: held like a model request, though it does not stream."""
    return path.split("?", 1)[0].endswith(COMPACT)


def parse_body(raw: bytes) -> object:
    """A (decoded) JSON request body, or None when it is not JSON (cheap for non-objects)."""
    if not raw or raw.lstrip()[:1] != b"{":
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def model_of(body: object) -> str | None:
    """A parsed request body's `model`, when it names one."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def asks_to_stream(body: object) -> bool:
    """A parsed request body with `"stream": true`."""
    return isinstance(body, dict) and body.get("stream") is True


# Content types that say what a body is when it is not an event stream: read whole and classified.
NOT_EVENT_STREAM = ("application/json", "application/problem+json", "text/html")


def held_as_stream(status: int, content_type: str | None, request_streams: bool) -> bool:
    """Whether an answer is an event stream to hold, frame and stream as SSE. By what it is, not only
    by its label: `text/event-stream`, or, to a request that asked to stream, a 2xx answer whose
    Content-Type is absent or names no other body (the real backend's SSE may carry none: a missing
    type is SSE, as other Codex proxies treat it). A JSON or HTML answer is still read whole and
    classified as the body it is; a non-2xx answer always is."""
    if not 200 <= status < 300:
        return False
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind == "text/event-stream":
        return True
    return request_streams and kind not in NOT_EVENT_STREAM


def is_websocket_upgrade(method: str, headers: Mapping[str, str]) -> bool:
    return method == "GET" and headers.get("upgrade", "").lower() == "websocket"


def swap_credential(headers: MutableMapping[str, str], auth: AuthMaterial, moved: bool) -> None:
    """Replace the identity headers with `auth`'s.

    A moved request (another credential than the client's own) carries only what belongs to that
    credential: the client's account-scoped headers (`ACCOUNT_SCOPED`) are dropped, and the
    credential's own declared organization / project (if any) are sent instead. A request that
    stays on its own credential keeps its account headers exactly as the client sent them."""
    _drop(headers, _AUTH_HEADERS)
    for name, value in auth.headers().items():
        headers[name] = value
    if moved:
        _drop(headers, ACCOUNT_SCOPED)
        for name, value in auth.account_headers().items():
            headers[name] = value


def _drop(headers: MutableMapping[str, str], names: Iterable[str]) -> None:
    """Remove every header in `names`, whatever the case of its name."""
    wanted = set(names)
    for key in [k for k in headers.keys() if k.lower() in wanted]:
        if key in headers:  # a case-insensitive mapping drops every spelling at once
            del headers[key]
