"""One small JSON exchange with an account's own upstream, through its route's first endpoint (or
directly): the status and the parsed JSON body. A `GET` of the usage endpoint with the account's own
headers (the usage re-check), or a `POST` of a token refresh (auth_refresh.py). Never a model request,
never logged with its headers or body."""

from __future__ import annotations

import asyncio
import json
import ssl

from ..core.routes import Endpoint
from ..ws.upstream import Target, tunnel
from .socks_bridge import SocksBridges

MAX_BODY = 1024 * 1024


class NoAnswer(TimeoutError):
    """The request was sent and no whole answer came (in time, or before the connection closed):
    the other side may have acted on it."""


async def get_json(url: str, headers: dict[str, str], via: Endpoint | None, bridges: SocksBridges,
                   tls: ssl.SSLContext, timeout: float) -> tuple[int, object]:
    """(status, JSON body or None). Raises OSError / TimeoutError / ValueError when it fails."""
    return await exchange_json("GET", url, headers, None, via, bridges, tls, timeout)


async def post_json(url: str, doc: object, via: Endpoint | None, bridges: SocksBridges, tls: ssl.SSLContext,
                    timeout: float, answer_timeout: float | None = None) -> tuple[int, object]:
    """`POST` `doc` as JSON: (status, JSON body or None). Raises as `get_json`; with
    `answer_timeout`, connecting is bounded by `timeout` and the answer, once the request is sent,
    by `answer_timeout`: NoAnswer when it does not come whole."""
    return await exchange_json("POST", url, {"Content-Type": "application/json"}, json.dumps(doc).encode(), via,
                               bridges, tls, timeout, answer_timeout)


async def exchange_json(method: str, url: str, headers: dict[str, str], body: bytes | None, via: Endpoint | None,
                        bridges: SocksBridges, tls: ssl.SSLContext, timeout: float,
                        answer_timeout: float | None = None) -> tuple[int, object]:
    target = Target.from_url(url)
    if answer_timeout is None:
        try:
            return await asyncio.wait_for(_exchange(method, target, headers, body, via, bridges, tls), timeout)
        except (IndexError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise ValueError(f"not an HTTP answer ({type(exc).__name__})") from None
    reader, writer = await asyncio.wait_for(tunnel(target, via, bridges, tls), timeout)
    try:
        return await asyncio.wait_for(_exchange(method, target, headers, body, via, bridges, tls, (reader, writer)),
                                      answer_timeout)
    except TimeoutError:
        raise NoAnswer(f"no answer within {answer_timeout:g}s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise NoAnswer(f"the connection closed before the answer ({type(exc).__name__})") from None
    except (IndexError, asyncio.LimitOverrunError) as exc:
        raise ValueError(f"not an HTTP answer ({type(exc).__name__})") from None


async def _exchange(method: str, target: Target, headers: dict[str, str], body: bytes | None, via, bridges,
                    tls, conn=None) -> tuple[int, object]:
    reader, writer = conn if conn is not None else await tunnel(target, via, bridges, tls)
    try:
        lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.authority}", "Accept: application/json",
                 "Accept-Encoding: identity", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *fields = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        names = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
        if names.get("transfer-encoding", "").lower() == "chunked":
            answer = await _chunked(reader)
        elif "content-length" in names:
            answer = await reader.readexactly(min(int(names["content-length"]), MAX_BODY))
        else:
            answer = await reader.read(MAX_BODY)
    finally:
        writer.close()
    try:
        return status, json.loads(answer)
    except ValueError:
        return status, None


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while len(body) < MAX_BODY:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            break
        take = min(size, MAX_BODY - len(body))  # each read within what is left of MAX_BODY, whatever a chunk claims
        body += await reader.readexactly(take)
        if take < size:
            break
        await reader.readexactly(2)
    return body
