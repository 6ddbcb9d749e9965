"""One `GET` of an account's usage endpoint with that account's own headers, through its route's first
endpoint (or directly): the status and the parsed JSON body. Used by the usage re-check only; never a
model request, never logged with its headers."""

from __future__ import annotations

import asyncio
import json
import ssl

from ..core.routes import Endpoint
from ..ws.upstream import Target, tunnel
from .socks_bridge import SocksBridges

MAX_BODY = 1024 * 1024


async def get_json(url: str, headers: dict[str, str], via: Endpoint | None, bridges: SocksBridges,
                   tls: ssl.SSLContext, timeout: float) -> tuple[int, object]:
    """(status, JSON body or None). Raises OSError / TimeoutError / ValueError when it fails."""
    try:
        return await asyncio.wait_for(_get(Target.from_url(url), headers, via, bridges, tls), timeout)
    except (IndexError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise ValueError(f"not an HTTP answer ({type(exc).__name__})") from None


async def _get(target: Target, headers: dict[str, str], via, bridges, tls) -> tuple[int, object]:
    reader, writer = await tunnel(target, via, bridges, tls)
    try:
        lines = [f"GET {target.path} HTTP/1.1", f"Host: {target.authority}", "Accept: application/json",
                 "Accept-Encoding: identity", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *fields = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        names = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
        if names.get("transfer-encoding", "").lower() == "chunked":
            body = await _chunked(reader)
        elif "content-length" in names:
            body = await reader.readexactly(min(int(names["content-length"]), MAX_BODY))
        else:
            body = await reader.read(MAX_BODY)
    finally:
        writer.close()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while len(body) < MAX_BODY:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            break
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    return body
