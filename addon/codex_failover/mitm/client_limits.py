"""A nested addon of FailoverAddon: descriptors are not for the taking. The decisions are
core/conn_budget.py's; this counts each client connection against its peer (its uid, read from the
kernel's socket table, or its address), refuses one over `failover_max_connections`, drops a client
that has not sent a whole request head within `failover_head_timeout`, and raises the soft
descriptor limit to the hard one at start. docs/machine-proxy.md, "Connections".
"""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import ctx, exceptions

from ..core.client_access import ip_of
from ..core.conn_budget import ConnectionBudget, peer_key
from ..core.units import parse_duration
from . import held_layer

log = logging.getLogger("codex_failover")
QUIET = 10.0  # seconds between two lines about refused or dropped connections (a flood is one line a while)
STALL = 1.0  # seconds a head timer may fire late before the loop counts as held up (then: one more)


def raise_descriptor_limit() -> None:
    """The soft limit on open descriptors raised to the hard one (Linux often starts services at 1024)."""
    try:
        import resource
    except ImportError:  # not Unix
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("codex-failover: open descriptors: soft limit %d raised to %d", soft, hard)
    except (OSError, ValueError) as exc:
        log.info("codex-failover: the descriptor limit could not be raised (%s)", exc)


class ClientLimits:
    def __init__(self, boundary) -> None:
        self.boundary = boundary  # the client boundary: the rule in force, the socket table, the proxy's uid
        self.budget = ConnectionBudget()
        self.head_timeout = 5.0
        self._raised = False
        self._peer: dict[str, str] = {}  # client id -> its budget key (while counted)
        self._timers: dict[str, asyncio.TimerHandle] = {}  # client id -> its head's deadline
        self._said = {"refused": 0.0, "dropped": 0.0}
        self._counts = {"refused": 0, "dropped": 0}

    def apply_options(self, updated: set[str]) -> None:
        """The addon's `configure` calls it inside its check of the options (not a hook of its own)."""
        if "failover_head_timeout" in updated:
            try:
                self.head_timeout = parse_duration(ctx.options.failover_head_timeout)
            except ValueError:
                raise exceptions.OptionsError(f"failover_head_timeout: {ctx.options.failover_head_timeout!r} is "
                                              "not a duration (e.g. 5s; 0 turns it off)") from None
        if "failover_max_connections" in updated:
            self.budget.cap = max(0, int(ctx.options.failover_max_connections))
            if not self._raised:  # once, at start: before the proxy listens
                self._raised = True
                raise_descriptor_limit()

    def client_connected(self, client) -> None:
        if not held_layer.is_proxy_client(client.id):
            return  # a kept connection's own stand-in client, not a peer's
        key = self._key(client)
        if key is not None and key != f"uid:{self.boundary.proxy_uid}":
            if not self.budget.admit(key):
                client.error = f"codex-failover: over failover_max_connections ({self.budget.cap}) for {key}"
                self._say("refused", f"connections refused: {key} holds failover_max_connections "
                                     f"({self.budget.cap}) already")
                return
            self._peer[client.id] = key
        if self.head_timeout > 0 and getattr(getattr(client, "proxy_mode", None), "type_name", "regular") == "regular":
            loop = asyncio.get_running_loop()
            self._timers[client.id] = loop.call_later(self.head_timeout, self._late, client.id,
                                                      loop.time() + self.head_timeout)

    def _key(self, client) -> str | None:
        peer, local = client.peername, client.sockname
        ip = ip_of(peer[0]) if peer else None
        uid = None
        if ip is not None and ip.is_loopback and local and self.boundary.can_map():
            uid = self.boundary.uid_of(peer, local)
            self.boundary.remember(client, uid)
        return peer_key(uid, str(ip) if ip is not None else None)

    def _headed(self, flow) -> None:
        timer = self._timers.pop(flow.client_conn.id, None)
        if timer is not None:
            timer.cancel()

    requestheaders = http_connect = _headed

    def client_disconnected(self, client) -> None:
        timer = self._timers.pop(client.id, None)
        if timer is not None:
            timer.cancel()
        key = self._peer.pop(client.id, None)
        if key is not None:
            self.budget.release(key)

    def _late(self, client_id: str, due: float | None) -> None:
        """The head timer fired. When it fired well after it was due, the proxy's loop was held up (a
        starved or stalled process): a head that arrived meanwhile is not read yet (timers run before the
        reads they overtook), so the client gets one more grace before it is dropped."""
        loop = asyncio.get_running_loop()
        if due is not None and loop.time() - due > STALL:
            self._timers[client_id] = loop.call_later(STALL, self._late, client_id, None)
            return
        self._timers.pop(client_id, None)
        if held_layer.drop_client(client_id, "no request head within failover_head_timeout"):
            self._say("dropped", f"clients dropped: no whole request head within failover_head_timeout "
                                 f"({self.head_timeout:g}s)")

    def _say(self, kind: str, text: str) -> None:
        self._counts[kind] += 1
        now = time.monotonic()
        if now - self._said[kind] >= QUIET:
            self._said[kind] = now
            log.warning("codex-failover: %s (%d since the last such line)", text, self._counts[kind])
            self._counts[kind] = 0
