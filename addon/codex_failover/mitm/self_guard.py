"""A nested addon of FailoverAddon: the proxy never connects to its own listeners, and a socket of
its own is never a client. The decisions are core/own_sockets.py's; this resolves a target's name,
asks the kernel which of its addresses are this machine's (a bind to it succeeds), and keeps the
local ends of the proxy's own server connections.

- `server_connect`: a dial whose port is one of the listeners' (the proxy's, the /metrics one) has its
  host resolved; when an address it resolves to reaches one of them, the dial is refused (the client
  gets mitmproxy's 502 with the reason), whatever the spelling (`127.1`, `0.0.0.0`, `2130706433`,
  `[::ffff:127.0.0.1]`, a name).
- `server_connected` / `server_disconnected`: both ends of each server connection are kept; a client
  connection that is the other end of one of them (a name that resolved elsewhere when asked and here
  when dialled) is the proxy's own socket: `is_own_socket` says so to the client boundary, which never
  treats it as a client.

docs/machine-proxy.md, "Who may use the pool".
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

from mitmproxy import ctx

from ..core import own_sockets

log = logging.getLogger("codex_failover")

REFUSED = "codex-failover: refused: {host}:{port} is this proxy's own listener"


def is_local(ip: str) -> bool:
    """Is `ip` an address of this machine? The kernel's answer: binding a socket to it succeeds."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def proxy_listeners() -> list[tuple[str, int]]:
    """The addresses mitmproxy's proxy servers are bound to (empty before they listen)."""
    server = ctx.master.addons.get("proxyserver") if getattr(ctx, "master", None) else None
    try:
        return [(str(a[0]), int(a[1])) for a in server.listen_addrs()] if server is not None else []
    except (AttributeError, TypeError, ValueError, IndexError):
        return []


class SelfGuard:
    def __init__(self, extra_listeners: Callable[[], list[tuple[str, int]]] = list,
                 listeners: Callable[[], list[tuple[str, int]]] = proxy_listeners,
                 local: Callable[[str], bool] = is_local) -> None:
        self._extra = extra_listeners  # the /metrics listener's address, while it serves
        self._listeners = listeners
        self._local = local
        # (local end, remote end) of each server connection; read by the /metrics thread too: replaced, never mutated
        self.own_ends: frozenset[tuple[tuple[str, int], tuple[str, int]]] = frozenset()
        self._ends: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {}  # server connection id -> its ends

    def listeners(self) -> list[tuple[str, int]]:
        return [*self._listeners(), *self._extra()]

    async def server_connect(self, data) -> None:
        if data.server.error or not data.server.address:
            return
        host, port = str(data.server.address[0]), int(data.server.address[1])
        listeners = self.listeners()
        if not any(p == port for _, p in listeners):
            return  # the common case: nothing to resolve
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return  # unresolvable: mitmproxy's own dial fails the same way
        targets = list(dict.fromkeys(str(info[4][0]) for info in infos))
        local = {t for t in targets if self._local(t)}
        if own_sockets.is_own_listener(targets, port, listeners, local):
            data.server.error = REFUSED.format(host=host, port=port)
            log.info("codex-failover: a connection to %s:%s refused: it is this proxy's own listener "
                     "(a client of %s asked for it)", host, port,
                     data.client.peername[0] if data.client.peername else "?")

    def server_connected(self, data) -> None:
        mine, theirs = own_sockets.end(data.server.sockname), own_sockets.end(data.server.peername)
        if mine is not None and theirs is not None:
            self._ends[data.server.id] = (mine, theirs)
            self.own_ends = frozenset(self._ends.values())

    def server_disconnected(self, data) -> None:
        if self._ends.pop(data.server.id, None) is not None:
            self.own_ends = frozenset(self._ends.values())

    def requestheaders(self, flow) -> None:
        """A request on a connection the proxy made to itself (a loop past the dial's check): killed."""
        if self.own_ends and self.is_own_socket(flow.client_conn.peername, flow.client_conn.sockname):
            log.info("codex-failover: a request from this proxy's own connection (%s %s): refused, a loop",
                     flow.request.method, flow.request.pretty_url)
            flow.kill()

    def is_own_socket(self, peer, local) -> bool:
        return own_sockets.is_own_socket(peer, local, self.own_ends)

    def owns(self, rule: Callable[[tuple, tuple], bool]) -> Callable[[tuple, tuple], bool]:
        """`rule` (peer, local) -> the user's own program?, never for the proxy's own socket (the /metrics listener's)."""
        return lambda peer, local: not self.is_own_socket(peer, local) and rule(peer, local)
