"""Connection trouble as the log tells it: a client that keeps failing its TLS handshake with the proxy
(core/handshake_watch.py decides when that is news), and an upstream the proxy could not connect to,
with its host. A nested addon of FailoverAddon; mitmproxy's own lines for both name neither the
pattern nor the host and are lowered to debug (quiet_log.py)."""

from __future__ import annotations

import logging
import time

from ..core.handshake_watch import HandshakeWatch

log = logging.getLogger("codex_failover")


def _host(data) -> str:
    context = data.context
    if context.client.sni:
        return context.client.sni
    address = context.server.address
    return f"{address[0]}:{address[1]}" if address else "an unknown host"


def _client(conn) -> str:
    peer = conn.peername
    return peer[0].removeprefix("::ffff:") if peer else "unknown"


class ConnTrouble:
    def __init__(self) -> None:
        self.watch = HandshakeWatch()

    def tls_established_client(self, data) -> None:
        self.watch.established(_client(data.context.client), _host(data))

    def tls_failed_client(self, data) -> None:
        line = self.watch.failed(_client(data.context.client), _host(data), data.conn.error or "closed", time.time())
        if line is not None:
            log.warning("codex-failover: %s", line)

    def server_connect_error(self, data) -> None:
        """mitmproxy says `error establishing server connection: <error>`: this line names the host."""
        address = data.server.address
        where = f"{address[0]}:{address[1]}" if address else "an unknown host"
        log.info("error establishing server connection to %s (for client %s): %s", where, _client(data.client),
                 data.server.error or "unknown error")
