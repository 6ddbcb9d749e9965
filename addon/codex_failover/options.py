"""The addon's mitmproxy options (`--set failover_...`); docs/options.md explains each one."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from .core.client_access import ClientAccess, ClientAccessError, is_loopback_host, parse_networks
from .core.intercept_scope import MODES as INTERCEPT_MODES
from .core.token_refresh import DEFAULT_URL as DEFAULT_REFRESH_URL
from .core.units import parse_size
from .core.view_filter import MODES as VIEW_MODES
from .metrics import parse_address

WEBSOCKET_MODES = ("downgrade", "gate", "passthrough")


def add_options(loader) -> None:
    loader.add_option("failover_config", str, "", "codex-failover pool file (YAML): spare credentials and policy.")
    loader.add_option("failover_rules", str, "", "codex-failover rules file (YAML); default: rules/default.yaml.")
    loader.add_option("failover_websocket", str, "gate",
                      "Codex WebSocket upgrades on model endpoints: gate (keep Codex's WebSocket; hold and "
                      "classify every turn and fail over as on HTTP), downgrade (answer 426, Codex uses SSE, "
                      "re-sending the whole history each request) or passthrough (untouched, unprotected).")
    loader.add_option("failover_intercept", str, "models",
                      "Which HTTPS connections are decrypted: models (only the Codex hosts and the pool's "
                      "base URLs; everything else is tunnelled untouched) or all (mitmproxy's usual behaviour).")
    loader.add_option("failover_clients", Sequence[str], [],
                      "Addresses or CIDRs, besides loopback, that may use the pool and the status page.")
    loader.add_option("failover_max_body", str, "32m",
                      "Largest request body the addon holds for failover (k/m/g suffixes); a larger one is "
                      "passed through untouched, without failover (holding costs a few times its size).")
    loader.add_option("failover_metrics", str, "",
                      "Serve Prometheus metrics at HOST:PORT/metrics (e.g. 127.0.0.1:9464); empty: off.")
    loader.add_option("failover_direct", bool, True,
                      "The first attempt, on the client's own credential to the URL it asked for, goes on the "
                      "client's own connection (mitmproxy's), its answer held there; off: every attempt goes "
                      "over the addon's kept upstream connections (a second flow each: more CPU a request).")
    loader.add_option("failover_token_refresh", bool, True,
                      "Refresh pooled ChatGPT logins' tokens as Codex does (before they end, past 8 days, once "
                      "after a 401), writing the new tokens back to their auth.json; off: never refresh.")
    loader.add_option("failover_refresh_url", str, DEFAULT_REFRESH_URL,
                      "The token endpoint pooled ChatGPT logins are refreshed at (for tests and gateways).")
    loader.add_option("failover_view", str, "all",
                      "What mitmweb (or mitmproxy's console) lists: all (every flow) or models (only the model "
                      "requests and the failover's attempts: sets view_filter to the model endpoints).")
    loader.add_option("failover_proxyauth_file", str, "",
                      "A private file (mode 0600) holding the proxy token USER:TOKEN, for mitmproxy's proxyauth "
                      "without the token in the command line (also: the variable CODEX_FAILOVER_PROXYAUTH).")
    loader.add_option("failover_head_timeout", str, "5s",
                      "A client connection that has not sent a whole request head (a CONNECT, a request) this "
                      "long after it opened is closed; 0: never.")
    loader.add_option("failover_max_connections", int, 512,
                      "Connections one peer (a local user other than the proxy's, or a remote address) may hold "
                      "open at once; more are refused. 0: no cap.")
    loader.add_option("failover_verbose", bool, False,
                      "Also log mitmproxy's per-connection lines (every client's, the attempts' and relay "
                      "hops') and mitmdump's flow echo; off: the addon's lines, warnings and errors only.")


def unknown_options(deferred: Iterable[str], known: Iterable[str]) -> list[str]:
    """One line per option given with --set that nothing knows (mitmproxy keeps them aside, in
    `options.deferred`, and says nothing) and that looks like one of the addon's: its name and the
    closest real one. The value is never shown (it may be a secret)."""
    ours = sorted(k for k in known if k.startswith("failover_"))
    out = []
    for name in sorted(set(deferred) - set(known)):
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6)
        if not close and not name.startswith(("failover", "codex")):
            continue
        hint = f"did you mean {close[0]}?" if close else f"the addon's options are {', '.join(ours)}"
        out.append(f"unknown option {name} (--set {name}=...) is ignored; {hint}")
    return out


@dataclass
class Parsed:
    clients: ClientAccess | None = None
    max_body: int | None = None


def parse_options(options, updated: set[str]) -> Parsed:
    """Check and parse the options that changed; ValueError with the line to show otherwise."""
    parsed = Parsed()
    if "failover_websocket" in updated and options.failover_websocket not in WEBSOCKET_MODES:
        raise ValueError(f"failover_websocket: {options.failover_websocket!r} is not one of {', '.join(WEBSOCKET_MODES)}")
    if "failover_intercept" in updated and options.failover_intercept not in INTERCEPT_MODES:
        raise ValueError(f"failover_intercept: {options.failover_intercept!r} is not one of {', '.join(INTERCEPT_MODES)}")
    if "failover_view" in updated and options.failover_view not in VIEW_MODES:
        raise ValueError(f"failover_view: {options.failover_view!r} is not one of {', '.join(VIEW_MODES)}")
    if "failover_clients" in updated:
        try:
            parsed.clients = ClientAccess(parse_networks(options.failover_clients))
        except ClientAccessError as exc:
            raise ValueError(str(exc)) from None
    if "failover_max_body" in updated:
        try:
            parsed.max_body = parse_size(options.failover_max_body)
        except ValueError:
            raise ValueError(f"failover_max_body: {options.failover_max_body!r} is not a size (e.g. 32m)") from None
    if "failover_refresh_url" in updated:
        parts = urlsplit(options.failover_refresh_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
            raise ValueError("failover_refresh_url: expected an https URL without user:password "
                             f"(default {DEFAULT_REFRESH_URL})")
        if parts.scheme == "http" and not is_loopback_host(parts.hostname):  # refresh tokens never in cleartext
            raise ValueError(f"failover_refresh_url: {parts.scheme}://{parts.hostname} would send refresh tokens in "
                             f"cleartext; use https (http only for a loopback host) (default {DEFAULT_REFRESH_URL})")
    if "failover_metrics" in updated and options.failover_metrics:
        parse_address(options.failover_metrics)
    if "mode" in updated and any(m.startswith("upstream:") for m in options.mode):
        # Upstream mode rewrites every attempt's `via` and would tunnel the relay hop away from
        # 127.0.0.1: the addon cannot work under it.
        raise ValueError("codex-failover does not work with --mode upstream:… (attempts choose their own upstream and "
                         "the committed stream is relayed over 127.0.0.1). Run in regular mode (the default).")
    return parsed
