"""The Prometheus listener (metrics.py): `GET /metrics` and nothing else, in its own daemon thread.

Any other path is 404, any other method 405. Bound to loopback, it also refuses (403) a request whose
Host is a name other than `localhost`, so a web page cannot read it through DNS rebinding; a peer the
pool's `failover_clients` rule does not allow gets 403 too, and so does a process of another user
than the proxy's (`owns`, core/client_boundary.py).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("codex_failover")

PATH = "/metrics"
REQUEST_TIMEOUT = 10.0  # a scrape connection's socket timeout: idle connections do not pile up
_POLL = 0.1  # the server loop's shutdown check: stop() returns within about this long


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 allows: Callable[[str], bool] | None = None, owns: Callable[[tuple, tuple], bool] | None = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self.allows = allows  # which peers may scrape (the pool's failover_clients rule); None: anyone
        self.owns = owns  # (peer, local address) -> is it the proxy user's own program (client_boundary)
        self.loopback = ipaddress.ip_address(host).is_loopback
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look the host's name up (socket.getfqdn): a DNS query, unneeded
        socketserver.TCPServer.server_bind(self)
        host, self.server_port = self.server_address[:2]
        self.server_name = str(host)  # (an address: the listener binds an IP)


def _host_allowed(host_header: str | None) -> bool:
    """Loopback only: no Host (HTTP/1.0), an IP literal, or `localhost`; a DNS name that resolves
    here is how a web page would reach the listener (DNS rebinding)."""
    if not host_header:
        return True
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT
    server_version = "codex-failover-metrics"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        if self.server.allows is not None and not self.server.allows(self.client_address[0]):
            return self._answer(403, b"forbidden: this proxy's metrics are for its own machine (failover_clients)\n")
        if not self._own():
            return self._answer(403, b"forbidden: this proxy's metrics are for the user who runs it\n")
        if self.server.loopback and not _host_allowed(self.headers.get("Host")):
            return self._answer(403, b"forbidden\n")
        if self.path.partition("?")[0] != PATH:
            return self._answer(404, b"not found: this listener serves GET /metrics only\n")
        try:
            body = generate_latest(self.server.registry)
        except Exception:  # noqa: BLE001 - one failed scrape, not a dead listener
            log.error("codex-failover internal error rendering the metrics", exc_info=True)
            return self._answer(500, b"internal error\n")
        self._answer(200, body, CONTENT_TYPE_LATEST)

    def _own(self) -> bool:
        """Looked up once per connection (a handler serves one connection)."""
        if self.server.owns is None:
            return True
        if not hasattr(self, "_owned"):
            self._owned = self.server.owns(self.client_address, self.connection.getsockname())
        return self._owned

    def _not_allowed(self) -> None:
        self._answer(405, b"method not allowed: this listener serves GET /metrics only\n", allow=True)

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                allow: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if allow:
            self.send_header("Allow", "GET")
        if status != 200:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the http.server signature
        log.debug("metrics: %s %s", self.address_string(), format % args)


class MetricsServer:
    """A running listener: `host`, `port` (the bound one, also for port 0), `url`, and `stop()`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 allows: Callable[[str], bool] | None = None, owns: Callable[[tuple, tuple], bool] | None = None) -> None:
        self._server = _Server(host, port, registry, allows, owns)
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": _POLL},
                                        name="codex-failover-metrics", daemon=True)
        self._thread.start()
        self._stopped = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PATH}"

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent. Returns within about 0.1 s."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


