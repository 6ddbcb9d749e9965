"""Masking secrets in text: the values the addon knows to be secret, and anything key-shaped. Pure.

Two users: what mitmproxy logs (mitm/secret_guard.py masks every log record, since with
proxy_debug and debug verbosity mitmproxy logs the bytes of each request head it writes, the real
credentials included), and upstream error text the addon forwards to a client (a gateway that
echoes the key it was given would otherwise hand a pooled key to whoever asked).

Known values are matched literally; besides them, OpenAI-style keys (`sk-…`, `sess-…`), JWTs
(`eyJ….….…`), whatever follows `Bearer ` and a `ChatGPT-Account-ID` header's value are masked
whatever they are, so a client's own key and account (never armed by the addon, logged by mitmproxy
as they arrive) are masked too.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

MASK = "<redacted by codex-failover>"
MIN_KNOWN = 6  # a shorter "secret" would mask ordinary words; shapes still catch keys and tokens
RECENT = 256  # armed values kept besides the pool's (a client's own key, an old pool's)
FRESH = 32  # values armed since the regex was built, tested as substrings until there are more
_TOKEN = r"[A-Za-z0-9._~+/=-]"
# Key shapes, each run only when its literal part is in the text (a substring test is a hundred
# times cheaper than a regex scan of a long log line).
_SHAPES = (
    (("sk-", "sess-"), re.compile(r"(?<![A-Za-z0-9])(?:sk|sess)-[A-Za-z0-9_-]{8,}"), MASK),  # OpenAI keys
    (("eyJ",), re.compile(r"eyJ[A-Za-z0-9_-]{6,}\.[A-Za-z0-9_-]{6,}(?:\.[A-Za-z0-9_-]*)?"), MASK),  # a JWT
    (("earer ",), re.compile(r"([Bb]earer )" + _TOKEN + "{6,}"), r"\1" + MASK),  # whatever a Bearer carries
    # a client's own ChatGPT account id, as a header in a logged head (bytes, a dict, JSON) at any verbosity
    (("ccount-id", "ccount-Id", "ccount-ID", "CCOUNT-ID"),
     re.compile(r"((?i:chatgpt-account-id)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;\\]{4,}"), r"\1" + MASK),
)


class Secrets:
    """The secret values in force: the pool's (replaced whole on each load) and the values armed
    recently (bounded), matched by one regex built again when the set changed.

    Building it is what costs (3.6 ms at 120 values), and every client credential seen arms a value:
    a value armed since is tested as a substring first, and the regex is built again only when one
    is in the text (the result is then the one regex's), past FRESH of them, or with another pool. A
    value dropped from the recent ones may be masked until then: more is masked, never less."""

    def __init__(self, recent: int = RECENT):
        self._pool: frozenset[str] = frozenset()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._limit = recent
        self._regex: re.Pattern[str] | None = None
        self._stale = False
        self._fresh: list[str] = []  # armed since the regex was built (not in it)
        self._source: Callable[[], object] | None = None  # see follow()
        self._values_of: Callable[[Any], Iterable[str]] = lambda pool: ()
        self._seen: object = None

    def follow(self, source: Callable[[], object], values_of: Callable[[Any], Iterable[str]]) -> None:
        """Take the pool's values from `source()` (the current pool) whenever it is another object
        than last time: nobody has to remember to tell, wherever the pool is replaced."""
        self._source, self._values_of, self._seen = source, values_of, None

    def _refresh(self) -> None:
        if self._source is not None:
            current = self._source()
            if current is not self._seen:
                self._seen = current
                self.set_pool(self._values_of(current))

    def set_pool(self, values: Iterable[str]) -> None:
        new = frozenset(v for v in values if v and len(v) >= MIN_KNOWN)
        if new != self._pool:
            self._pool, self._stale = new, True

    def add(self, values: Iterable[str]) -> None:
        """Values being armed now (on an attempt or a CONNECT): known from here on."""
        for value in values:
            if not value or len(value) < MIN_KNOWN or value in self._pool:
                continue
            if value in self._recent:
                self._recent.move_to_end(value)
                continue
            self._recent[value] = None
            self._fresh.append(value)
            if len(self._recent) > self._limit:  # (the regex may mask it until it is built again)
                self._recent.popitem(last=False)
            if len(self._fresh) > FRESH:
                self._stale = True

    def clear(self) -> None:
        self._pool, self._stale, self._source, self._seen = frozenset(), True, None, None
        self._recent.clear()
        self._fresh = []

    def known(self) -> set[str]:
        self._refresh()
        return set(self._pool) | set(self._recent)

    def _pattern(self, text: str) -> re.Pattern[str] | None:
        if self._fresh and not self._stale and any(value in text for value in self._fresh):
            self._stale = True
        if self._stale:
            values = sorted(self.known(), key=len, reverse=True)  # the longest first: a value inside another
            self._regex = re.compile("|".join(map(re.escape, values))) if values else None
            self._stale, self._fresh = False, []
        return self._regex

    def mask(self, text: str) -> str:
        """`text` with every known value and every key-shaped word replaced by MASK."""
        self._refresh()
        pattern = self._pattern(text)
        if pattern is not None:
            text = pattern.sub(MASK, text)
        for needles, shape, mask in _SHAPES:
            if any(n in text for n in needles):
                text = shape.sub(mask, text)
        return text

    def mask_in(self, value: object) -> object:
        """The same through a JSON-like value (dicts, lists, strings), for an error object."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, dict):
            return {k: self.mask_in(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask_in(v) for v in value]
        return value


def header_secrets(value: str) -> list[str]:
    """The secret parts of an identity header's value: the whole value, and the token after an
    auth scheme (`Bearer x` -> `x`), since a log may show either."""
    scheme, _, token = value.strip().partition(" ")
    return [value, token] if token and scheme.lower() in ("bearer", "basic") else [value]

