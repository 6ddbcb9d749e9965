"""Which of the seam's ways to mitmproxy's proxy core are in use, chosen at start.

Each part of the seam that leans on mitmproxy's internals has a fallback on its public API, used on a
mitmproxy release the contract tests were not run on (tests/test_warm_conn_contract.py,
tests/test_held_stream.py, tests/test_ws_layer_socket.py; `scripts/test-mitmproxy`
runs them on another release), or when forced by `CODEX_FAILOVER_FALLBACK` (a comma-separated list of
the names below; for tests and for a user who suspects the seam):

  hop     every held client is answered through the loopback relay, not in its own layers (held_stream.py)
  goaway  mitmproxy's own HTTP/2 GOAWAY handling: the whole connection closes (warm_conn.py)
  wsleg   the gated WebSocket's upstream sockets on the gate's own asyncio, TLS and wsproto stack
          (ws/upstream.py), not on mitmproxy's layers (ws/layer_socket.py)
  engine  every attempt on an HTTP/1.1 connection of its own that the addon dials and speaks itself
          (own_conn.py), not a stream on a kept connection run by mitmproxy's layers (warm_conn.py);
          implies wsleg (the gate's layer sockets are attempts on kept connections too)
"""

from __future__ import annotations

import os

from mitmproxy.version import VERSION

# The releases the contract tests pass on (each run with scripts/test-mitmproxy); pyproject.toml admits
# their range, and a release inside it that is not listed here gets every fallback.
TESTED = ("12.0.0", "12.0.1", "12.1.0", "12.1.1", "12.1.2", "12.2.0", "12.2.1", "12.2.2", "12.2.3",
          "12.3.0", "12.3.1")
NAMES = ("hop", "goaway", "wsleg", "engine")
ENV = "CODEX_FAILOVER_FALLBACK"
WHAT = {"hop": "answers through the loopback relay (one more local connection per request)",
        "goaway": "mitmproxy's own GOAWAY handling (a GOAWAY cuts every stream of that connection)",
        "wsleg": "the gated WebSocket dials its upstream sockets itself (routes and other addons' hooks apply, "
                 "mitmproxy's upstream modes and its WebSocket layer do not)",
        "engine": "each attempt dials a connection of its own, HTTP/1.1 (a handshake per attempt, no kept or "
                  "pre-warmed connection)"}


def forced() -> set[str]:
    return {name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip()}


def seam_holds(name: str) -> bool:
    """Is the seam's way `name` used (not its fallback)?"""
    chosen = forced()
    if name == "wsleg" and "engine" in chosen:
        return False
    return VERSION in TESTED and name not in chosen


def in_force() -> list[str]:
    """What is in use instead of the seam: on an untested mitmproxy, one line (every fallback); else
    one per fallback `CODEX_FAILOVER_FALLBACK` asks for, and one for a name it does not know."""
    if VERSION not in TESTED:
        lines = [f"codex-failover: mitmproxy {VERSION} is not a release the seam was tested on ({TESTED[0]} to "
                 f"{TESTED[-1]}): every part runs on mitmproxy's public API instead ({', '.join(NAMES)}; slower, "
                 f"a handshake per attempt; docs/architecture.md#the-seam)"]
    else:
        lines = [f"codex-failover: {name}: {WHAT[name]}; {ENV} asks for it" for name in NAMES if not seam_holds(name)]
    unknown = sorted(forced() - set(NAMES))
    if unknown:
        lines.append(f"codex-failover: {ENV}: unknown name(s) {', '.join(unknown)} (known: {', '.join(NAMES)})")
    return lines
