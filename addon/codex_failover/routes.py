"""Egress routes: ordered pools of proxy endpoints, and their health. Pure, clock injected.

A dead endpoint backs off exponentially (30 s floor, 300 s cap by default) without penalising
the credential that used it. While it backs off it is never dialled; when the backoff ends, one
request probes it (others keep skipping it until that probe succeeds or fails).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import unquote, urlsplit

DIRECT = "direct"
SCHEMES = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}


class RouteError(ValueError):
    pass


@dataclass(frozen=True)
class Endpoint:
    route: str
    index: int
    scheme: str  # http, https, socks5 (socks5h semantics: the proxy resolves names)
    host: str
    port: int
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return f"{self.route}#{self.index}"

    @property
    def label(self) -> str:
        """For logs, comments and status: never the credentials."""
        return f"{self.route}[{self.index}] {self.scheme}://{self.host}:{self.port}"

    @property
    def is_socks(self) -> bool:
        return self.scheme.startswith("socks5")


def parse_endpoint(route: str, index: int, url: object) -> Endpoint:
    if not isinstance(url, str) or not url:
        raise RouteError(f"routes.{route}[{index}]: expected a proxy URL such as http://host:3128")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RouteError(f"routes.{route}[{index}]: cannot parse the proxy URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise RouteError(f"routes.{route}[{index}]: unsupported scheme {scheme or '(none)'!r} "
                         f"(supported: {', '.join(sorted(SCHEMES))})")
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise RouteError(f"routes.{route}[{index}]: expected scheme://[user:password@]host[:port]")
    return Endpoint(route, index, "socks5" if scheme == "socks5h" else scheme, parts.hostname, port or SCHEMES[scheme],
                    unquote(parts.username) if parts.username else None,
                    unquote(parts.password) if parts.password else None)


def parse_routes(doc: object) -> dict[str, tuple[Endpoint, ...] | None]:
    """`{name: [url, ...] | "direct"}` -> endpoints per route (None: direct)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise RouteError("routes: expected a mapping of route name to a list of proxy URLs (or direct)")
    routes: dict[str, tuple[Endpoint, ...] | None] = {}
    for name, value in doc.items():
        if not isinstance(name, str) or not name:
            raise RouteError(f"routes: route names must be non-empty strings, got {name!r}")
        if value == DIRECT:
            routes[name] = None
            continue
        if not isinstance(value, list) or not value:
            raise RouteError(f"routes.{name}: expected a non-empty list of proxy URLs, or direct")
        routes[name] = tuple(parse_endpoint(name, i, url) for i, url in enumerate(value))
    return routes


@dataclass
class _EndpointState:
    failures: int = 0
    until: float = 0.0
    reason: str = ""
    probing: bool = False


class RouteHealth:
    def __init__(self, floor: float = 30.0, cap: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.floor, self.cap = floor, cap
        self._clock = clock
        self._states: dict[str, _EndpointState] = {}

    def claim(self, ep: Endpoint) -> bool:
        """May `ep` be dialled now? Not while it backs off; once the backoff has ended, only by the
        first caller (the probe) until that probe reports `failed` or `succeeded`."""
        state = self._states.get(ep.key)
        if state is None or state.failures == 0:
            return True
        if state.probing or self._clock() < state.until:
            return False
        state.probing = True
        return True

    def failed(self, ep: Endpoint, reason: str) -> float:
        """A confirmed pre-dispatch failure; returns the backoff in seconds."""
        state = self._states.setdefault(ep.key, _EndpointState())
        state.failures += 1
        backoff = min(self.cap, self.floor * 2 ** (state.failures - 1))
        state.until, state.reason, state.probing = self._clock() + backoff, reason, False
        return backoff

    def succeeded(self, ep: Endpoint) -> None:
        self._states.pop(ep.key, None)

    def release(self, ep: Endpoint) -> None:
        """A claimed probe ended without a verdict on the endpoint (e.g. the client left)."""
        state = self._states.get(ep.key)
        if state is not None:
            state.probing = False

    def describe(self, ep: Endpoint) -> str:
        state = self._states.get(ep.key)
        if state is None or state.failures == 0:
            return "up"
        left = state.until - self._clock()
        if state.probing:
            return f"being probed (failed {state.failures}x: {state.reason})"
        if left > 0:
            return f"backing off {left:.0f}s more (failed {state.failures}x: {state.reason})"
        return f"due for a probe (failed {state.failures}x: {state.reason})"
