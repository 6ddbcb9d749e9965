"""Which TLS connections the proxy decrypts. Pure.

Left on as a machine's HTTPS proxy, the addon must cost other programs nothing: only the model
endpoints are intercepted (the Codex hosts and every host the pool sends requests to); any other
CONNECT is tunnelled untouched, so pip, git or npm see the origin's own certificate and never need
mitmproxy's CA. See docs/machine-proxy.md.
"""

from __future__ import annotations

from typing import Iterable
from urllib.parse import urlsplit

from .codex_request import KNOWN_BASE_URLS

MODELS = "models"  # intercept only the model endpoints (the default)
ALL = "all"  # mitmproxy's own behaviour: intercept everything (a debugging session)
MODES = (MODELS, ALL)


class InterceptScope:
    """The set of host names whose TLS is intercepted, matched case-insensitively (a set lookup)."""

    def __init__(self, base_urls: Iterable[str] = ()):
        hosts = {urlsplit(u).hostname for u in (*KNOWN_BASE_URLS, *base_urls)}
        self.hosts = frozenset(h.lower().rstrip(".") for h in hosts if h)

    def intercepts(self, sni: str | None, connect_host: str | None) -> bool:
        """`sni`: the name the client asked for in its ClientHello; `connect_host`: the CONNECT
        target (used when the client sends no SNI, e.g. to an IP address)."""
        name = sni or connect_host
        return name is not None and name.lower().rstrip(".") in self.hosts
