"""The gate's own upstream WebSockets: TCP (directly, or through a route endpoint's HTTP CONNECT;
SOCKS endpoints through their loopback bridge), TLS for wss, then the upgrade.

mitmproxy cannot replay a WebSocket, so a turn that moves needs a socket the addon owns.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi

from ..core.routes import Endpoint
from ..core.transport import classify_connection_error
from ..core.vocabulary import PRE_DISPATCH
from ..net.socks_bridge import SocksBridges
from ..net.trust import add_system_trust
from .conn import WsConn


class ConnectFailed(Exception):
    """No upgrade was sent: `kind` is a transport class (pre_dispatch, host_network, tls_failed...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Target:
    secure: bool
    host: str
    port: int
    path: str  # with the query

    @classmethod
    def from_url(cls, url: str) -> "Target":
        parts = urlsplit(url)
        secure = parts.scheme in ("https", "wss")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(secure, parts.hostname or "", parts.port or (443 if secure else 80), path)

    @property
    def authority(self) -> str:
        return self.host if self.port == (443 if self.secure else 80) else f"{self.host}:{self.port}"


async def open_upstream(target: Target, headers: list[tuple[bytes, bytes]], via: Endpoint | None,
                        bridges: SocksBridges, tls: ssl.SSLContext, connect_timeout: float,
                        response_timeout: float, deflate: bool) -> WsConn:
    """An open WebSocket to `target`. Raises ConnectFailed before the upgrade left, or
    HandshakeRejected / ConnectionError / TimeoutError after."""
    try:
        reader, writer = await asyncio.wait_for(tunnel(target, via, bridges, tls), connect_timeout)
    except TimeoutError:
        raise ConnectFailed(PRE_DISPATCH, f"timed out connecting after {connect_timeout:g}s") from None
    except ConnectFailed:
        raise
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        raise ConnectFailed(classify_connection_error(message, response_started=False), message) from None
    try:
        return await asyncio.wait_for(WsConn.connect(reader, writer, target.authority, target.path, headers, deflate),
                                      response_timeout)
    except BaseException:
        writer.close()
        raise


async def tunnel(target: Target, via: Endpoint | None, bridges: SocksBridges, tls: ssl.SSLContext):
    server_name = target.host if target.secure else None
    if via is None:
        return await asyncio.open_connection(target.host, target.port, ssl=tls if target.secure else None,
                                             server_hostname=server_name)
    if via.is_socks:
        host, port = await bridges.address(via)
        proxy_tls = None
    else:
        host, port = via.host, via.port
        proxy_tls = tls if via.scheme == "https" else None  # an https proxy: verified like the upstream
    reader, writer = await asyncio.open_connection(host, port, ssl=proxy_tls, server_hostname=host if proxy_tls else None)
    try:
        await _connect_through(reader, writer, target, via, bridges)
        if target.secure:
            await writer.start_tls(tls, server_hostname=server_name)
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _connect_through(reader, writer, target: Target, via: Endpoint, bridges: SocksBridges) -> None:
    host = f"[{target.host}]" if ":" in target.host else target.host  # IPv6 literal
    lines = [f"CONNECT {host}:{target.port} HTTP/1.1", f"Host: {host}:{target.port}"]
    authorization = bridges.proxy_authorization(via)
    if authorization is not None:
        lines.append(f"Proxy-Authorization: {authorization}")  # to this proxy (or bridge) only
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1] if head.count(b" ") >= 1 else b""
    if status != b"200":
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        raise ConnectFailed(PRE_DISPATCH, f"refused HTTP CONNECT request ({line})")


_tls: tuple | None = None  # (the options it was built from, the context)


def upstream_tls(opts) -> ssl.SSLContext:
    """The addon's own upstream TLS (the gate's own sockets, the engine's fallback) for mitmproxy's
    options, built again only when they change."""
    global _tls
    key = (opts.ssl_insecure, opts.ssl_verify_upstream_trusted_ca, opts.ssl_verify_upstream_trusted_confdir)
    if _tls is None or _tls[0] != key:
        _tls = (key, tls_context(*key))
    return _tls[1]


def tls_context(insecure: bool, cafile: str | None = None, capath: str | None = None) -> ssl.SSLContext:
    """Upstream TLS as for every other attempt: certifi's bundle, the machine's trust store and
    mitmproxy's own CA options (ssl_verify_upstream_trusted_*); ssl_insecure turns checks off."""
    context = ssl.create_default_context(cafile=certifi.where())
    if cafile or capath:
        context.load_verify_locations(cafile or None, capath or None)
    add_system_trust(context)
    # As mitmproxy's own upstream TLS (OpenSSL without X509_STRICT) checks it: Python 3.13 made the strict
    # checks its default, which refuse a CA without an Authority Key Identifier, as many corporate
    # TLS-inspecting CAs are. The model requests passed there while the addon's own sockets (token refresh,
    # usage, the gate's) failed.
    context.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context
