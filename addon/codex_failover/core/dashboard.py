"""The dashboard's view model: what each row of `http://codex-failover.status/` says, from the status
report (core/status.py) and the activity since start (core/activity.py). Pure: the page's script
only puts these strings and numbers where they go (mitm/status_page.py serves both).

Every credential, the clients' own accounts among them, gets a row: its state and why, the time left
on a rest, its usage windows as bars (the 5-hour and the weekly window, with their reset times), its
token's end. Then route health, the counts since start, the recent requests, and the internals (the
proxy's own counters, for a bug report) in a section of their own.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

from .activity import Activity, RequestRecord
from .token_expiry import left
from .vocabulary import OUTPUT, Verdict

WINDOW_LABELS = {"primary": "5-hour", "secondary": "weekly"}
# The report's keys the page shows elsewhere; every other top-level key is an internal.
_SHOWN = frozenset({"pool", "credentials", "clients", "routes", "counts", "recent", "held_requests",
                    "attempts_in_flight", "websockets"})
BADGES = {"ready": "ok", "cooling": "rest", "out": "out", "expired": "out"}


def clock_time(at: float) -> str:
    return time.strftime("%H:%M", time.localtime(at))


def _window(w: Mapping[str, Any], now: float, clock: Callable[[float], str]) -> dict[str, Any]:
    used = w.get("used_percent")
    percent = max(0.0, min(100.0, float(used))) if isinstance(used, (int, float)) else 0.0
    at = w.get("resets_at")
    if isinstance(at, (int, float)):
        resets = f"resets {clock(at)} (in {left(at - now)})" if at > now else "reset due"
    else:
        resets = "reset time unknown"
    name = str(w.get("window", ""))
    return {"label": WINDOW_LABELS.get(name, name), "percent": round(percent, 1), "text": f"{percent:g}% used",
            "resets": resets, "full": percent >= 100}


def rest_left(seconds: float) -> str:
    """Time left on a rest: seconds under a minute, else as token_expiry.left says it."""
    return f"{max(0, round(seconds))} s" if seconds < 60 else left(seconds)


def _why(entry: Mapping[str, Any]) -> str:
    state, reason = entry.get("state"), entry.get("reason")
    if state == "ready":
        return "in rotation"
    if state == "cooling":
        return f"resting: {reason}" if reason else "resting"
    if state == "expired":
        return f"token expired; {reason}" if reason else "token expired"
    return f"out of rotation: {reason}" if reason else "out of rotation"


def _usage_note(windows: list[Any], asked: Mapping[str, str], key: str, state: str) -> str | None:
    if windows:
        return asked.get(key)
    if state in ("cooling", "expired", "out"):
        return "usage not asked while it rests"
    return asked.get(key) or "usage not known yet"


def credential_rows(report: Mapping[str, Any], now: float, asked: Mapping[str, str] | None = None,
                    clock: Callable[[float], str] = clock_time) -> list[dict[str, Any]]:
    """One row per pooled credential, then one per client's own account seen here. `asked`: the
    usage poll's note per key (`asked 2 min ago`, `could not be asked: …`)."""
    asked = asked or {}
    rows = []
    for c in report.get("credentials", ()):
        state = c.get("state", "ready")
        windows = [_window(w, now, clock) for w in c.get("usage_windows", ())]
        token = None
        if "token_expires_in_s" in c and state != "expired":
            token = f"token expires in {left(c['token_expires_in_s'])}"
        rows.append({"name": c["name"], "key": c["name"], "kind": c.get("kind"), "own": False, "state": state,
                     "badge": BADGES.get(state, "out"), "why": _why(c),
                     "rest_left": rest_left(c["cooling_for_s"]) if state == "cooling" and "cooling_for_s" in c else None,
                     "windows": windows, "usage_note": _usage_note(windows, asked, c["name"], state), "token": token,
                     "resettable": state in ("cooling", "out"), "reset": c["name"],
                     "route": c.get("route"), "ended": _ended(c)})
    for c in report.get("clients", ()):
        state = c.get("state", "ready")
        windows = [_window(w, now, clock) for w in c.get("usage_windows", ())]
        seen = c.get("seen_s_ago")
        key = c["label"]  # (the usage poll's notes name a client's account by its label)
        rows.append({"name": f"own account ({c['label']})", "key": key, "kind": c.get("kind"),
                     "own": True, "state": state, "badge": BADGES.get(state, "out"), "why": _why(c),
                     "rest_left": rest_left(c["cooling_for_s"]) if state == "cooling" and "cooling_for_s" in c else None,
                     "windows": windows, "usage_note": _usage_note(windows, asked, key, state),
                     "token": None, "resettable": state in ("cooling", "out"),
                     "reset": reset_name(c["label"]), "route": None,
                     "seen": f"last request {left(seen)} ago" if isinstance(seen, (int, float)) else "not seen here",
                     "ended": _ended(c)})
    return rows


def reset_name(label: str) -> str:
    """What `POST /reset/NAME` (and `failover.reset`) names a client's own account by: its label's tail
    (`account …1a2b` -> `1a2b`, `key #1a2b3c4d` -> `1a2b3c4d`)."""
    return label.rpartition("…")[2].rpartition("#")[2].strip()


def _ended(entry: Mapping[str, Any]) -> str | None:
    e = entry.get("cooldown_ended")
    return f"cooldown ended {left(e['s_ago'])} ago ({e['how']})" if isinstance(e, Mapping) else None


def route_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"endpoint": r["endpoint"], "state": r["state"], "ok": r["state"] == "up"} for r in report.get("routes", ())]


def count_rows(counts: Mapping[str, Any], report: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = [{"label": "requests", "value": counts.get("requests", 0)},
            {"label": "served", "value": counts.get("served", 0)},
            {"label": "moved away", "value": counts.get("moved_away", 0),
             "hint": "served by another credential than the first one tried"},
            {"label": "not served", "value": counts.get("not_served", 0),
             "hint": "answered by the proxy: nothing could serve it"},
            {"label": "held now", "value": report.get("held_requests", 0)},
            {"label": "websockets open", "value": len(report.get("websockets", ()))}]
    return rows


def _attempt(t: Any) -> dict[str, Any]:
    verdict = str(t.verdict)
    ok = verdict in (Verdict.COMMIT, Verdict.DELIVER)
    return {"credential": t.credential, "verdict": verdict, "reason": t.reason, "ok": ok,
            "text": f"{t.credential}: {verdict}" + ("" if ok and t.reason == OUTPUT else f" ({t.reason})")}


def _tokens(tokens: Mapping[str, int] | None) -> str:
    if not tokens:
        return ""
    parts = [f"{_short(tokens[k])} {label}" for k, label in (("input_tokens", "in"), ("output_tokens", "out"))
             if k in tokens]
    return " / ".join(parts) or f"{_short(tokens.get('total_tokens', 0))} total"


def _short(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10000 else str(n)


def request_rows(records: Iterable[RequestRecord], clock: Callable[[float], str] = lambda at: time.strftime(
        "%H:%M:%S", time.localtime(at))) -> list[dict[str, Any]]:
    """The recent requests, newest first."""
    rows = []
    for r in reversed(list(records)):
        attempts = [_attempt(t) for t in r.tries]
        served = r.served_by
        if served is not None:
            result = f"served by {served}" + (" (moved)" if r.moved else "")
        elif r.outcome is not None:
            result = r.outcome
        elif r.tries and r.tries[-1].verdict == Verdict.CANCELLED:
            result = "client left"
        else:
            result = "in progress"
        rows.append({"id": r.request_id, "time": clock(r.at), "session": r.session, "model": r.model,
                     "transport": r.transport, "attempts": attempts, "result": result,
                     "ok": served is not None, "moved": r.moved,
                     "first_output": f"{r.first_output_ms} ms" if r.first_output_ms is not None else "",
                     "tokens": _tokens(r.tokens)})
    return rows


def internals(report: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in _SHOWN}


def view(report: Mapping[str, Any], activity: Activity, now: float, asked: Mapping[str, str] | None = None,
         clock: Callable[[float], str] = clock_time) -> dict[str, Any]:
    """The whole page's model."""
    counts = activity.counts()
    return {"pool": report.get("pool") or "(no pool file: the client's own credential only)",
            "credentials": credential_rows(report, now, asked, clock),
            "routes": route_rows(report),
            "counts": count_rows(counts, report),
            "rejections": [{"reason": k, "count": v} for k, v in counts["rejections"].items()],
            "recent": request_rows(activity.recent),
            "internals": internals(report)}
