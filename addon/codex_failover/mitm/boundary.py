"""The client boundary's shell: a nested addon of FailoverAddon that tells the request hook which requests are the
user's own programs' and may be lent the pool. The rules are core/client_boundary.py's; this reads
/proc/net/tcp and /proc/net/tcp6 (once per client connection), keeps the rule in force for the
options, and forgets a refused key the upstream served after all. docs/machine-proxy.md, "Who may
use the pool".
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

from mitmproxy import ctx, exceptions, http

from .. import proxy_token
from ..core import client_boundary as rules
from ..core.auth import AuthMaterial, auth_from_headers
from ..core.client_access import ip_of
from ..net import sock_diag
from . import client_answers, secret_guard

log = logging.getLogger("codex_failover")

LISTINGS = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
MAX_CONNECTIONS = 4096  # owners remembered (each dropped when its connection closes)
PASSED = "codex-failover.passed"  # flow metadata: why this model request was not lent the pool


def read_listings() -> list[str]:
    """The kernel's TCP socket listings (each may be missing: no IPv6, not Linux)."""
    out = []
    for path in LISTINGS:
        try:
            out.append(path.read_text())
        except OSError:
            pass
    return out


def can_map_sockets() -> bool:
    return sys.platform.startswith("linux") and os.access(LISTINGS[0], os.R_OK)


class ClientBoundary:
    """Which clients are this user's programs (the rule in force), and which credentials were refused."""

    def __init__(self, listings=read_listings, proxy_uid: int | None = None,
                 is_self: Callable[[tuple | None, tuple | None], bool] = lambda peer, local: False) -> None:
        self._listings = listings
        self._is_self = is_self  # a client socket that is the proxy's own connection (self_guard.py): never a client
        self.proxy_uid = os.geteuid() if proxy_uid is None else proxy_uid
        self.rule = rules.ANYONE
        self.rejected = rules.RejectedKeys()
        self._own: dict[str, bool] = {}  # client connection id -> its socket is the proxy uid's

    # -- hooks -------------------------------------------------------------------------------

    def apply_options(self, updated: set[str]) -> None:
        """The addon's `configure` calls it inside its check of the options (not a hook of its own)."""
        if proxy_token.OPTION in updated or not updated:
            try:
                value = proxy_token.token(getattr(ctx.options, proxy_token.OPTION, ""), os.environ)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
            if value and not getattr(ctx.options, "proxyauth", None):
                secret_guard.SECRETS.add([value, value.partition(":")[2]])  # masked in any log
                ctx.options.proxyauth = value  # mitmproxy's own check of every client, as --proxyauth
        if "proxyauth" in updated or not updated:
            self.rule = rules.rule_for(getattr(ctx.options, "proxyauth", None), can_map_sockets())
            self._own.clear()

    def running(self) -> None:
        log.info("codex-failover: %s", rules.describe_rule(self.rule, self.proxy_uid))

    def client_disconnected(self, client) -> None:
        self._own.pop(client.id, None)

    def response(self, flow: http.HTTPFlow) -> None:
        """A refused key passed through: refused again, it is remembered from now; served after all
        (under 400), it is forgotten."""
        if flow.metadata.get(PASSED) != "refused_key" or flow.response is None:
            return
        auth = auth_from_headers(flow.request.headers)
        if auth is None:
            return
        if flow.response.status_code in (401, 403):
            self.rejected.refused(auth.fingerprint)
        elif flow.response.status_code < 400:
            self.rejected.accepted(auth.fingerprint)

    # -- what the request hook asks ----------------------------------------------------------

    def is_own(self, client) -> bool:
        """Is this client connection the user's own program (rule in force)? Looked up once per connection."""
        known = self._own.get(client.id)
        if known is None:
            known = not self._is_self(client.peername, client.sockname) and self.owns(client.peername, client.sockname)
            if len(self._own) >= MAX_CONNECTIONS:
                self._own.pop(next(iter(self._own)))
            self._own[client.id] = known
            if not known:
                log.info("codex-failover: a client of another user (%s:%s): passed through on its own "
                         "credential, no pool and no status page", *client.peername[:2])
        return known

    # -- for the connection limits (client_limits.py) -----------------------------------------

    def can_map(self) -> bool:
        return can_map_sockets()

    def remember(self, client, uid: int | None) -> None:
        """The uid of a client's socket, found when it connected: the rule's answer needs no lookup again.
        A socket not found then (the kernel did not answer in time, on a loaded machine) is not remembered:
        its first request asks again (`is_own`), and an unknown socket is still not the user's own."""
        if uid is None:
            return
        if self.rule == rules.UID and client.id not in self._own and not self._is_self(client.peername, client.sockname):
            if len(self._own) >= MAX_CONNECTIONS:
                self._own.pop(next(iter(self._own)))
            self._own[client.id] = rules.is_own(self.rule, True, uid, self.proxy_uid)

    def owns(self, peer, local) -> bool:
        """The rule for one socket: `peer` the client's (ip, port, ...), `local` the proxy's end."""
        ip = ip_of(peer[0]) if peer else None
        loopback = bool(ip is not None and ip.is_loopback)
        uid = None
        if self.rule == rules.UID and loopback and local:
            uid = self.uid_of(peer, local)
        return rules.is_own(self.rule, loopback, uid, self.proxy_uid)

    def uid_of(self, peer, local) -> int | None:
        """The uid owning a loopback client's socket: the kernel's answer for that socket (sock_diag),
        else the socket listings' (/proc/net/tcp, tcp6)."""
        uid = sock_diag.tcp_owner(peer[:2], local[:2])
        return uid if uid is not None else rules.owner_uid(self._listings(), peer[:2], local[:2], sys.byteorder)

    def passed_by(self, flow: http.HTTPFlow, auth: AuthMaterial) -> str | None:
        """Why this model request is not lent the pool: a browser's, another user's, or its
        credential was refused by the upstream lately; None: it may be."""
        sign = rules.browser_sign(flow.request.headers)
        if sign is not None:
            return self._passed(flow, "browser", f"a browser's request ({sign} header)")
        if not self.is_own(flow.client_conn):
            return self._passed(flow, "other_user", "a client of another user")
        if auth.fingerprint in self.rejected:
            return self._passed(flow, "refused_key", "its credential was refused by the upstream (401/403) lately")
        return None

    @staticmethod
    def _passed(flow: http.HTTPFlow, kind: str, why: str) -> str:
        flow.metadata[PASSED] = kind
        log.debug("codex-failover: %s %s: %s; passed through on its own credential, without the pool",
                  flow.request.method, flow.request.pretty_url, why)
        return kind


def not_own_user() -> http.Response:
    """The status page (and its details) for a client of another user: refused."""
    error = {"type": "permission_error", "code": "client_not_allowed",
             "message": "codex-failover: this proxy's pool and status page serve only the user who runs it"}
    return client_answers.json_error(403, error)
