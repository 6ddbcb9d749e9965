"""Egress routes: ordered pools of proxy endpoints, and their health. Pure, clock injected.

A dead endpoint backs off exponentially (30 s floor, 300 s cap by default) without penalising
the credential that used it. While it backs off it is never dialled; when the backoff ends, one
request probes it (others keep skipping it until that probe succeeds or fails).

The edge's refusal (`edge_refused`: a Cloudflare challenge or block, a region 403) is one account's
answer until a second says the same: the first refusal backs off only that (credential, endpoint) pair
for the floor, once per episode (a refusal while the pair backs off counts no more); a refusal to
another credential through the same endpoint during that episode backs the endpoint off for everyone.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import unquote, urlsplit

from .tracked import Tracked

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


# Leading characters of credentials that get pasted where a name or URL belongs: OpenAI API keys,
# ChatGPT session keys, PEM blocks; a copied Authorization value; JWTs (base64 of '{"').
_SECRET_PREFIXES = ("sk-", "sess-", "-----begin")
_JWT = re.compile(r"eyj[a-z0-9_-]{10,}")
_MIXED = re.compile(r"(?=.*[a-z])(?=.*[0-9])[a-z0-9_\-]+")
_SEPARATORS = re.compile(r"[\s=:,;'\"]+")


def _secret_word(word: str) -> bool:
    return word.startswith(_SECRET_PREFIXES) or bool(_JWT.match(word)) or (len(word) >= 32 and bool(_MIXED.fullmatch(word)))


def looks_like_secret(text: str) -> bool:
    """Is `text` (or a word of it: `OPENAI_API_KEY=sk-...`, `Bearer ey...`) probably a credential
    (an API key, a JWT, a long random token)? Such a value is never echoed in a message."""
    t = text.strip().lower()
    if len(t) > 64 or t.startswith("bearer "):
        return True
    return any(_secret_word(w) for w in _SEPARATORS.split(t) if w)


def redact_url(url: str) -> str:
    """`url` as it may appear in a message: the user:password part (everything up to the last '@'
    of the authority, whatever characters the password holds), a non-numeric port, query, fragment
    and secret-looking path segments are replaced by ***. Without `scheme://` nothing is shown,
    since where the secret ends cannot be told."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return "(not shown: no scheme://)"
    userinfo = ""
    at = rest.rfind("@")
    if at >= 0:
        userinfo, rest = "***@", rest[at + 1:]
    tail = ""
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        tail, rest = rest[cut] + "***", rest[:cut]
    authority, slash, path = rest.partition("/")
    if authority.startswith("["):  # [IPv6]:port
        close = authority.find("]")
        host, after = (authority[:close + 1], authority[close + 1:]) if close >= 0 else ("***", "")
        colon, port = (":", after[1:]) if after.startswith(":") else ("", "")
    else:
        host, colon, port = authority.partition(":")
    if looks_like_secret(host):
        host = "***"
    shown_port = f":{port if port.isdigit() else '***'}" if colon else ""
    segments = ["***" if looks_like_secret(seg) else seg for seg in path.split("/")] if slash else []
    shown = f"{scheme.lower()}://{userinfo}{host}{shown_port}{slash}{'/'.join(segments)}{tail}"
    return shown if len(shown) <= 200 else shown[:197] + "..."


def parse_endpoint(route: str, index: int, url: object) -> Endpoint:
    where = f"routes.{route}[{index}]"
    if not isinstance(url, str) or not url:
        raise RouteError(f"{where}: expected a proxy URL such as http://host:3128")
    shown = redact_url(url)  # never the user:password part: messages are logged
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RouteError(f"{where}: expected scheme://[user:password@]host[:port] (no scheme:// found)")
    at = rest.rfind("@")
    if at >= 0 and any(c in rest[:at] for c in "/?#"):
        raise RouteError(f"{where}: the user:password part holds '/', '?' or '#': percent-encode them "
                         f"(%2F, %3F, %23) so the URL can be parsed ({shown})")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        # urlsplit's own text quotes parts of the URL (the password too): never pass it on.
        problem = "the port is not a number from 1 to 65535" if "port" in str(exc).lower() else \
            "the host part is malformed"
        raise RouteError(f"{where}: cannot parse the proxy URL: {problem} ({shown})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        shown_scheme = scheme if scheme and not looks_like_secret(scheme) else "(none)"
        raise RouteError(f"{where}: unsupported scheme {shown_scheme!r} "
                         f"(supported: {', '.join(sorted(SCHEMES))})")
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise RouteError(f"{where}: expected scheme://[user:password@]host[:port] ({shown})")
    if port == 0:
        raise RouteError(f"{where}: the port is not a number from 1 to 65535 ({shown})")
    return Endpoint(route, index, "socks5" if scheme == "socks5h" else scheme, parts.hostname, port or SCHEMES[scheme],
                    unquote(parts.username) if parts.username else None,
                    unquote(parts.password) if parts.password else None)


def parse_routes(doc: object) -> dict[str, tuple[Endpoint, ...] | None]:
    """`{name: [url, ...] | "direct"}` -> endpoints per route (None: direct). Messages name the
    route and the entry, never a URL's user:password part."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise RouteError("routes: expected a mapping of route name to a list of proxy URLs (or direct)")
    routes: dict[str, tuple[Endpoint, ...] | None] = {}
    for name, value in doc.items():
        if not isinstance(name, str) or not name:
            raise RouteError(f"routes: route names must be non-empty strings, got a {type(name).__name__}")
        if looks_like_secret(name) or "://" in name or "@" in name:
            raise RouteError("routes: a route name looks like a URL or a secret (not shown); "
                             "use a short name and put the proxy URLs in its list")
        if value == DIRECT:
            routes[name] = None
            continue
        if not isinstance(value, list) or not value:
            hint = " (a single URL goes in a list too: [URL])" if isinstance(value, str) else ""
            raise RouteError(f"routes.{name}: expected a non-empty list of proxy URLs, or direct{hint}")
        routes[name] = tuple(parse_endpoint(name, i, url) for i, url in enumerate(value))
    return routes


@dataclass
class _EndpointState:
    failures: int = 0
    until: float = 0.0
    reason: str = ""
    probing: bool = False


MAX_EDGE_PAIRS = 4096  # (credential, endpoint) pairs an edge refused, remembered at most (the oldest go first)


class RouteHealth(Tracked):
    """Backoff per endpoint. A failure, a success after failures and a restore are tracked
    (`Tracked`) for the state keeper; a probe's claim and release are not stored, nor are the
    (credential, endpoint) pairs an edge refused (in memory: they last one floor)."""

    def __init__(self, floor: float = 30.0, cap: float = 300.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.floor, self.cap = floor, cap
        self._clock = clock
        self._states: dict[str, _EndpointState] = {}
        self._edge: dict[tuple[str, str], tuple[float, str]] = {}  # (endpoint key, credential) -> (until, reason)

    def claim(self, ep: Endpoint, who: str | None = None) -> bool:
        """May `ep` be dialled now (for credential `who`)? Not while it backs off, nor for a credential
        whose pair with it backs off; once the backoff has ended, only by the first caller (the probe)
        until that probe reports `failed` or `succeeded`."""
        if who is not None and self.pair_until(ep, who) > 0:
            return False
        state = self._states.get(ep.key)
        if state is None or state.failures == 0:
            return True
        if state.probing or self._clock() < state.until:
            return False
        state.probing = True
        return True

    def healthy(self, ep: Endpoint) -> bool:
        """Has `ep` no failure on record? (Only those are dialled ahead of need.)"""
        state = self._states.get(ep.key)
        return state is None or state.failures == 0

    def failed(self, ep: Endpoint, reason: str) -> float:
        """A confirmed pre-dispatch failure; returns the backoff in seconds."""
        state = self._states.setdefault(ep.key, _EndpointState())
        state.failures += 1
        backoff: float = min(self.cap, self.floor * 2 ** (state.failures - 1))
        state.until, state.reason, state.probing = self._clock() + backoff, reason, False
        self._changed(ep.key)
        return backoff

    def edge_refused(self, ep: Endpoint, who: str, reason: str) -> tuple[bool, float]:
        """The edge refused credential `who` through `ep` (a claimed attempt's answer). Returns (the
        endpoint backs off for everyone, seconds): it does when another credential's pair with `ep`
        backs off too (two accounts, one answer: the route's); else only this pair does, for the floor,
        and a refusal during its episode counts no more. Either way the claim is over."""
        now = self._clock()
        for pair in [p for p, (until, _) in self._edge.items() if until <= now]:
            del self._edge[pair]
        if any(key == ep.key and cred != who for key, cred in self._edge):
            for pair in [p for p in self._edge if p[0] == ep.key]:
                del self._edge[pair]
            return True, self.failed(ep, reason)
        self.release(ep)
        until = self._edge.setdefault((ep.key, who), (now + self.floor, reason))[0]
        while len(self._edge) > MAX_EDGE_PAIRS:
            del self._edge[next(iter(self._edge))]
        return False, until - now

    def pair_until(self, ep: Endpoint, who: str) -> float:
        """Seconds left of the backoff of the pair (`who`, `ep`) an edge refused (0: none)."""
        entry = self._edge.get((ep.key, who))
        return max(0.0, entry[0] - self._clock()) if entry is not None else 0.0

    def succeeded(self, ep: Endpoint) -> None:
        if self._states.pop(ep.key, None) is not None:
            self._changed(ep.key)

    def release(self, ep: Endpoint) -> None:
        """A claimed probe ended without a verdict on the endpoint (e.g. the client left)."""
        state = self._states.get(ep.key)
        if state is not None:
            state.probing = False

    def entries(self) -> list[tuple[str, int, float, str]]:
        """(endpoint key, failures, until on this clock, reason) of every endpoint backing off."""
        return [(key, st.failures, st.until, st.reason) for key, st in self._states.items() if st.failures]

    def backing_off_until(self, ep: Endpoint) -> float:
        """Until when `ep` backs off on this clock (0 when it does not)."""
        state = self._states.get(ep.key)
        return state.until if state is not None and state.failures else 0.0

    def restore(self, ep: Endpoint, failures: int, until: float, reason: str) -> None:
        """A backoff remembered from before a restart (`until` on this clock)."""
        self._states[ep.key] = _EndpointState(failures=failures, until=until, reason=reason)
        self._changed(ep.key)

    def stored(self, key: str) -> tuple[int, float, str] | None:
        """(failures, until on this clock, reason) of an endpoint backing off (for the state keeper)."""
        state = self._states.get(key)
        return (state.failures, state.until, state.reason) if state is not None and state.failures else None

    def keys(self) -> list[str]:
        return list(self._states)

    def describe(self, ep: Endpoint, who: str | None = None) -> str:
        left_pair = self.pair_until(ep, who) if who is not None else 0.0
        if left_pair > 0:
            why = self._edge[(ep.key, who or "")][1]
            return f"{why} for this credential: not sent through it for {left_pair:.0f}s more (up for the others)"
        state = self._states.get(ep.key)
        if state is None or state.failures == 0:
            return "up"
        left = state.until - self._clock()
        if state.probing:
            return f"being probed (failed {state.failures}x: {state.reason})"
        if left > 0:
            return f"backing off {left:.0f}s more (failed {state.failures}x: {state.reason})"
        return f"due for a probe (failed {state.failures}x: {state.reason})"


def looks_like_key(name: str) -> bool:
    """Is a credential's `name:` probably a pasted key rather than a name? Names are shown in every
    log line, status page and metric, so a key there would be everywhere: `sk-…`/`sess-…`, a JWT,
    a long letters-and-digits run (core/routes.looks_like_secret), or a random-looking run of 20+
    letters and digits. Random: letters and digits change class at most characters (a chosen name,
    even in camel case with a year, changes far less often) and spread over 3.5 bits a character."""
    if looks_like_secret(name):
        return True
    run = max(re.findall(r"[A-Za-z0-9]+", name), key=len, default="")
    if len(run) < 20 or not (any(c.isdigit() for c in run) and any(c.isalpha() for c in run)):
        return False
    kinds = ["d" if c.isdigit() else "u" if c.isupper() else "l" for c in run]
    changes = sum(a != b for a, b in zip(kinds, kinds[1:], strict=False)) / (len(run) - 1)
    counts = [run.count(c) for c in set(run)]
    bits = -sum(n / len(run) * math.log2(n / len(run)) for n in counts)
    return changes >= 0.45 and bits > 3.5


def name_problem(name: object, shown: str) -> str:
    """Why a credential's `name` is refused (`shown`: the name as a message may show it): a name that
    looks like a key is said to be one, without showing it; any other bad name is shown its form."""
    if isinstance(name, str) and looks_like_key(name):
        return ("looks like a key or token, not a name (not shown); name the credential (e.g. work) and give "
                "its key through api_key_env or auth_file")
    return f"expected 1-64 characters of letters, digits, '.', '_' or '-', got {shown}"
