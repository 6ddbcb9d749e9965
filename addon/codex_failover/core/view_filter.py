"""`failover_view=models`: the mitmproxy view filter that shows only the model flows, the clients'
requests to a model endpoint (HTTP and WebSocket) and the failover's attempts, and hides every other
call (plugins, analytics, `wham/*`, other hosts). Pure: built from the model endpoints the addon holds.

One `~u` clause per endpoint, on the URL as mitmproxy shows it (`pretty_url`: scheme, host, the port
only when it is not the scheme's default, path). Written without backslashes (`[.]`, `[?]`), so the
filter language's quoting leaves the regex as it is.
"""

from __future__ import annotations

from typing import Iterable

from .codex_request import COMPACT, KNOWN_BASE_URLS, RESPONSES, ModelEndpoint

ALL, MODELS = "all", "models"
MODES = (ALL, MODELS)
_DEFAULT_PORTS = {"https": 443, "http": 80}


def _literal(text: str) -> str:
    """`text` as a regex that matches it literally, without a backslash."""
    out = []
    for c in text:
        if c.isalnum() or c in "/-_:~%@!,;=&'":
            out.append(c)
        elif c in '"^]\\':  # not in a URL (percent-encoded there): any character, not worth a backslash
            out.append(".")
        else:
            out.append(f"[{c}]")
    return "".join(out)


def models_filter(base_urls: Iterable[str] = ()) -> str:
    """The filter expression that matches the model endpoints' flows (KNOWN_BASE_URLS and `base_urls`)."""
    clauses = []
    for e in sorted({ModelEndpoint.from_base_url(u) for u in (*KNOWN_BASE_URLS, *base_urls)},
                    key=lambda e: (e.host, e.port, e.path)):
        port = f"(:{e.port})?" if _DEFAULT_PORTS.get(e.scheme) == e.port else f":{e.port}"
        path = _literal(e.path.removesuffix(RESPONSES))
        tail = _literal(RESPONSES) + "(" + _literal(COMPACT.removeprefix(RESPONSES)) + ")?([?]|$)"
        clauses.append(f'~u "^{e.scheme}://{_literal(e.host)}{port}{path}{tail}"')
    return " | ".join(clauses)
