"""HTTP CONNECT -> SOCKS5 bridges on 127.0.0.1, one per SOCKS endpoint.

mitmproxy can only chain to HTTP(S) proxies (`server_conn.via`). An attempt routed through a
SOCKS5 endpoint is therefore pointed at a local bridge that answers mitmproxy's CONNECT by opening
the tunnel through the SOCKS5 server (socks5h: the SOCKS server resolves names; python-socks does the
handshake). A failed handshake is answered `502` before any request byte moved, so mitmproxy reports
a refused CONNECT: a confirmed pre-dispatch failure.

A bridge spends its endpoint's SOCKS password, so it serves only the addon: each has a random
secret that its CONNECTs carry in `Proxy-Authorization`; anything else gets a 407 before the SOCKS
server is touched. Bridges are keyed by the whole endpoint (credentials included) and closed when
the pool changes, so a new password or server is used at once.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import secrets
from urllib.parse import quote

from python_socks import ProxyError, ProxyTimeoutError
from python_socks.async_.asyncio import Proxy

from ..core.routes import Endpoint

log = logging.getLogger("codex_failover")
CONNECT_TIMEOUT = 10.0
_PIPE_CHUNK = 65536


def _identity(ep: Endpoint) -> tuple:
    return ep.scheme, ep.host, ep.port, ep.username, ep.password


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class SocksBridges:
    def __init__(self) -> None:
        self._servers: dict[tuple, tuple[asyncio.Server, str]] = {}  # endpoint -> (bridge, its secret)
        self._lock = asyncio.Lock()

    async def address(self, ep: Endpoint) -> tuple[str, int]:
        """The loopback address of `ep`'s bridge, started on first use."""
        async with self._lock:
            entry = self._servers.get(_identity(ep))
            if entry is None:
                secret = _basic("codex-failover", secrets.token_urlsafe(32))
                server = await asyncio.start_server(lambda r, w: _serve(ep, secret, r, w), "127.0.0.1", 0)
                entry = self._servers[_identity(ep)] = (server, secret)
        return entry[0].sockets[0].getsockname()[:2]

    def port(self, ep: Endpoint) -> int | None:
        """The bridge's loopback port, if it runs (for the status page: it serves only the addon)."""
        entry = self._servers.get(_identity(ep))
        return entry[0].sockets[0].getsockname()[1] if entry else None

    def proxy_authorization(self, ep: Endpoint) -> str | None:
        """What a CONNECT through `ep` carries in Proxy-Authorization: an HTTP proxy's own
        credentials, or a SOCKS bridge's secret (after `address`); None when nothing."""
        if ep.is_socks:
            entry = self._servers.get(_identity(ep))
            return entry[1] if entry else None
        return _basic(ep.username, ep.password or "") if ep.username is not None else None

    async def close(self) -> None:
        """Stop listening (tunnels already open go on); the next use starts new bridges."""
        servers, self._servers = self._servers, {}
        for server, _ in servers.values():
            server.close()


def _proxy_url(ep: Endpoint) -> str:
    auth = ""
    if ep.username is not None:
        auth = quote(ep.username, safe="") + (":" + quote(ep.password or "", safe="")) + "@"
    host = f"[{ep.host}]" if ":" in ep.host else ep.host  # an IPv6 literal
    return f"socks5://{auth}{host}:{ep.port}"


async def _serve(ep: Endpoint, secret: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
        request_line, *lines = head.decode("latin-1").split("\r\n")
        given = next((v.strip() for n, _, v in (h.partition(":") for h in lines) if n.strip().lower() == "proxy-authorization"), "")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            log.debug("SOCKS bridge for %s:%d: refused a connection without the addon's secret", ep.host, ep.port)
            await _refuse(writer, "407 Proxy Authentication Required", "codex-failover: this bridge serves the addon only")
            return
        method, target, _ = request_line.split(" ", 2)
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or not host or not port.isdigit():
            await _refuse(writer, "400 Bad Request", "expected CONNECT host:port")
            return
        try:
            sock = await Proxy.from_url(_proxy_url(ep), rdns=True).connect(host.strip("[]"), int(port), timeout=CONNECT_TIMEOUT)
        except (ProxyError, ProxyTimeoutError, OSError, ValueError) as exc:
            # The message names the SOCKS failure; it never holds the endpoint's password.
            await _refuse(writer, "502 Bad Gateway", f"SOCKS5 {ep.host}:{ep.port}: {type(exc).__name__}: {exc}")
            return
        up_reader, up_writer = await asyncio.open_connection(sock=sock)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await pipe_both(reader, writer, up_reader, up_writer)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _refuse(writer: asyncio.StreamWriter, status: str, reason: str) -> None:
    body = reason.encode("utf-8", "replace")
    writer.write(f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def pipe_both(a_reader, a_writer, b_reader, b_writer) -> None:
    """Copy both ways until each side ends; each direction closes its destination when done."""
    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(_PIPE_CHUNK):
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    await asyncio.gather(pipe(a_reader, b_writer), pipe(b_reader, a_writer))
