"""The loopback relay: how a committed attempt's stream reaches the held client live.

mitmproxy sends a response that an addon sets in one piece, so the client flow is pointed at
this server instead (127.0.0.1, ephemeral port). It answers `GET/POST /r/<token>` once: the
winner's status and headers, the bytes held during the bootstrap window, then the live rest,
chunk by chunk. Unknown or reused tokens get 403. When the reader (mitmproxy, on behalf of the
client) goes away, the session's `abort` runs so the upstream attempt stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

log = logging.getLogger("codex_failover")

_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"proxy-connection"}
_MAX_HEAD = 64 * 1024
UNCLAIMED_TTL = 30.0  # a committed stream nobody fetches is dropped after this


class UpstreamBroken(ConnectionError):
    """Raised by a session's body when the upstream failed mid-stream: the relay then closes
    without the final chunk, so the client sees a truncated stream, as it would have directly."""


@dataclass
class RelaySession:
    status: int
    reason: str
    headers: list[tuple[bytes, bytes]]
    body: Callable[[], AsyncIterator[bytes]]  # held bytes first, then live chunks; raises on upstream failure
    abort: Callable[[], object]  # stop the upstream attempt (may return an awaitable)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))


class Relay:
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._sessions: dict[str, RelaySession] = {}
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self.port = 0
        self.streaming = 0  # sessions being served right now

    async def start(self) -> None:
        """Idempotent: listen on an ephemeral loopback port unless already listening."""
        async with self._lock:
            if self._server is None:
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
                self.port = self._server.sockets[0].getsockname()[1]

    def register(self, session) -> str:
        """A RelaySession (HTTP), or any session with `token`, `abort()` and
        `serve(head, reader, writer)` (a gated WebSocket)."""
        self._sessions[session.token] = session
        loop = asyncio.get_running_loop()
        loop.call_later(UNCLAIMED_TTL, self._expire, session.token)
        return session.token

    def _expire(self, token: str) -> None:
        session = self._sessions.pop(token, None)
        if session is not None:
            log.warning("relay: a committed stream or gated WebSocket was never fetched; dropping it")
            self._spawn(_maybe_await(session.abort()))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for token in list(self._sessions):
            session = self._sessions.pop(token)
            await _maybe_await(session.abort())

    @property
    def pending(self) -> int:
        return len(self._sessions)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = None
        try:
            session, head = await self._claim(reader, writer)
            if session is not None:
                self.streaming += 1
                try:
                    if isinstance(session, RelaySession):
                        await self._serve(session, reader, writer)
                    else:  # a gated WebSocket: it speaks for itself
                        await session.serve(head, reader, writer)
                finally:
                    self.streaming -= 1
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if session is not None:
                await _maybe_await(session.abort())
            writer.close()

    async def _claim(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """The session named by the request's token (and the request head), or None."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if len(head) > _MAX_HEAD:
            return None, head
        request_line, *header_lines = head.split(b"\r\n")
        parts = request_line.split(b" ")
        token = parts[1].decode("latin-1").removeprefix("/r/") if len(parts) == 3 and parts[1].startswith(b"/r/") else ""
        session = self._sessions.pop(token, None)
        await _discard_body(reader, header_lines)
        if session is None:
            writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        return session, head

    async def _serve(self, session: RelaySession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Stream the session until it ends, or until the reader leaves (then stop at once)."""
        loop = asyncio.get_running_loop()
        pump = loop.create_task(self._pump(session, writer))
        gone = loop.create_task(reader.read(1))  # b"" when the reader leaves; it never sends more
        done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        if pump in done:
            gone.cancel()
            pump.result()  # re-raise an upstream failure: the connection closes without the last chunk
            return
        pump.cancel()
        try:
            await pump
        except (asyncio.CancelledError, ConnectionError):
            pass

    @staticmethod
    async def _pump(session: RelaySession, writer: asyncio.StreamWriter) -> None:
        head = [f"HTTP/1.1 {session.status} {session.reason or 'OK'}".encode()]
        head += [k + b": " + v for k, v in session.headers if k.lower() not in _HOP_BY_HOP]
        head += [b"transfer-encoding: chunked", b"connection: close", b"", b""]
        writer.write(b"\r\n".join(head))
        async for chunk in session.body():
            if chunk:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _discard_body(reader: asyncio.StreamReader, header_lines: list[bytes]) -> None:
    """Read the forwarded request body (the relay never needs it) so closing is clean."""
    for line in header_lines:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            remaining = int(value.strip() or 0)
            while remaining > 0:
                data = await asyncio.wait_for(reader.read(min(remaining, 65536)), 10)
                if not data:
                    return
                remaining -= len(data)


async def _maybe_await(result) -> None:
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result
