"""The `failover.status` command and the status page: pool health and in-flight counters, as data
(no secrets), and as the lines the command prints. Pure: the addon hands over its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from . import token_expiry

if TYPE_CHECKING:
    from .cooldown_end import Ended
    from .health import Health
    from .policy import PoolConfig
    from .routes import RouteHealth
    from .seen_clients import SeenClients
    from .usage import UsageBook


def build(pool: PoolConfig, health: Health, usage: UsageBook, seen_clients: SeenClients, route_health: RouteHealth,
          bridges: Any, counters: dict[str, Any], ended: Mapping[str, Ended] | None = None) -> dict[str, Any]:
    """The report: every credential, the clients' own credentials (by label), every route endpoint,
    then `counters` (held requests, attempts, relay, connections, WebSockets). `ended`: health key ->
    how its last cooldown ended early (cooldown_end.Ended)."""
    now = health.now()
    ended = ended or {}

    def early(key: str) -> dict[str, Any]:
        e = ended.get(key)
        return {"cooldown_ended": {"how": e.how, "was": e.was, "s_ago": round(now - e.at)}} if e else {}

    creds = []
    for cred in pool.credentials:
        state = health.state(cred.name)
        entry: dict[str, Any] = {"name": cred.name, "kind": cred.kind, "base_url": cred.base_url, "route": cred.route,
                 "state": state.status, "reason": state.reason, "usage": usage.describe(cred.name),
                 "usage_windows": [{"window": w.name, "used_percent": w.used_percent, "resets_at": w.resets_at}
                                   for w in usage.windows(cred.name)]}
        if state.status == "cooling" and state.until is not None:
            entry["cooling_for_s"] = round(state.until - now, 1)
        entry.update(early(cred.name))
        token = token_expiry.describe(cred, now)
        if token is not None:  # a ChatGPT token: when it ends, and the command that refreshes it
            entry.update(token)
        if cred.auth.expires_at is not None and cred.auth.expires_at <= now:
            entry["state"], entry["reason"] = "expired", f"refresh it: {token_expiry.refresh_command(cred)}"
        creds.append(entry)
    for skip in pool.skipped:  # configured, but its auth file cannot be used now
        creds.append({"name": skip.name, "kind": "-", "base_url": "-", "route": "-", "state": "skipped",
                      "reason": f"{skip.problem}; {token_expiry.login_command(skip.auth_file)}", "usage": "-",
                      "usage_windows": []})
    seen = {key: (name, kind, round(ago)) for key, name, kind, ago in seen_clients.recent()}
    # Plus clients' credentials not seen here but cooling or out (learnt from a shared store).
    others = [key for key, *_ in health.entries() if key.startswith("client:") and key not in seen]
    clients: list[dict[str, Any]] = []
    for key in [*seen, *others]:
        name, kind, ago = seen.get(key, (f"key #{key[7:15]}", None, None))
        state = health.state(key)
        entry = {"label": name, "kind": kind, "seen_s_ago": ago, "state": state.status, "reason": state.reason,
                 "usage_windows": [{"window": w.name, "used_percent": w.used_percent, "resets_at": w.resets_at}
                                   for w in usage.windows(key)]}
        if state.status == "cooling" and state.until is not None:
            entry["cooling_for_s"] = round(state.until - now, 1)
        entry.update(early(key))
        clients.append(entry)
    routes = [{"endpoint": ep.label, "state": route_health.describe(ep),
               **({"bridge_port": port} if (port := bridges.port(ep)) else {})}
              for endpoints in pool.routes.values() for ep in endpoints or ()]
    return {"pool": pool.source, "credentials": creds, "clients": clients, "routes": routes, **counters}


def render(report: dict[str, Any]) -> str:
    """The command's text: one line per credential, client credential, route and WebSocket."""
    lines = [f"codex-failover pool: {report['pool'] or '(no file: client credential only)'}"]
    for c in report["credentials"]:
        text = c["state"]
        if c["state"] == "cooling":
            text += f" for {c['cooling_for_s']:.0f}s more ({c['reason']})"
        elif c["state"] in ("out", "expired", "skipped"):
            text += f": {c['reason']}"
        if "cooldown_ended" in c:
            e = c["cooldown_ended"]
            text += f" (cooldown ended {e['s_ago']}s ago: {e['how']})"
        if "token_expires_in_s" in c and c["state"] != "expired":
            text += f"; token expires in {token_expiry.left(c['token_expires_in_s'])} ({c['refresh']})"
        lines.append(f"  {c['name']:<20} {c['kind']:<8} {c['base_url']:<45} {text}; {c['usage']}")
    for c in report["clients"]:
        text = c["state"] + (f" for {c['cooling_for_s']:.0f}s more ({c['reason']})" if c["state"] == "cooling"
                             else f": {c['reason']}" if c["reason"] else "")
        seen = f"seen {c['seen_s_ago']}s ago" if c["seen_s_ago"] is not None else "not seen here"
        lines.append(f"  client {c['label']:<13} {c['kind'] or '-':<8} {seen}: {text}")
    lines += [f"  route {r['endpoint']:<40} {r['state']}" for r in report["routes"]]
    lines += [f"  websocket {w['id']:<6} on {w['credential']} via {w['route']}: {w['turns']} turn(s), {w['moves']} move(s)"
              f"{', holding a turn' if w['holding'] else ''}, open {w['open_s']:.0f}s" for w in report["websockets"]]
    lines.append(f"  held requests: {report['held_requests']}, attempts in flight: {report['attempts_in_flight']}, "
                 f"relay: {report['relay_streaming']} streaming, {report['relay_unclaimed']} unclaimed")
    return "\n".join(lines)
