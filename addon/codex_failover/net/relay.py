"""The loopback relay: how a gated WebSocket reaches its client, and a held request's answer when
the in-process hop cannot be used (mitm/held_stream.py, docs/architecture.md#the-held-stream).

mitmproxy sends a response that an addon sets in one piece, so the client flow is pointed at
this server instead (127.0.0.1, ephemeral port), as soon as the hold starts: mitmproxy connects
and forwards the request while the attempts run, and the relay answers `GET/POST /r/<token>` once
the run has decided (`RelaySession.answer`): the winner's status and headers, the bytes held during
the bootstrap window, then the live rest, chunk by chunk; or the addon's own answer. So a commit
costs one write, and a client that leaves (or resets its HTTP/2 stream) during the hold is noticed
at once: mitmproxy closes this hop, and the session's `abort` stops the run and its attempts.
Unknown or reused tokens get 403.

Anything on the machine can connect to the port, so every other connection is answered or closed
quietly (one debug line, never a traceback): a malformed head gets 400, an unknown token 403 before
any body is read, and every wait has a deadline, so idle or trickling connections cannot pile up.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

log = logging.getLogger("codex_failover")

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"proxy-connection"}
_MAX_HEAD = 64 * 1024  # the stream limit: a longer head is answered 431
UNCLAIMED_TTL = 30.0  # a committed stream nobody fetches is dropped after this
# mitmproxy connects and sends its request at once, from memory, over loopback: these are generous
# for it and short for anything else.
HEAD_TIMEOUT = 5.0  # a new connection's whole request head
BODY_TIMEOUT = 10.0  # the whole forwarded request body (not per read: trickling gains nothing)
LINGER = 1.0  # after a refusal, unread input is drained this long (see _refuse)

_TCHAR = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(_TCHAR + rb" (\S+) HTTP/1\.[01]")
_HEADER_NAME = re.compile(_TCHAR)
_DECIMAL = re.compile(rb"[0-9]{1,18}")  # bounded: int() of a huge digit string raises
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
CHUNKED = -1  # the body length of a chunked request


class Refused(Exception):
    """A connection the relay closes unserved: `answer` (a status line's code and reason), if any,
    is sent first; `why` is the debug line."""

    def __init__(self, why: str, answer: bytes | None = None):
        super().__init__(why)
        self.answer = answer


class UpstreamBroken(ConnectionError):
    """Raised by a session's body when the upstream failed mid-stream: the relay then closes
    without the final chunk, so the client sees a truncated stream, as it would have directly."""


@dataclass
class RelaySession:
    status: int | None
    reason: str
    headers: list[tuple[bytes, bytes]]
    body: Callable[[], AsyncIterator[bytes]] | None  # held bytes first, then live chunks; raises on upstream failure
    abort: Callable[[], object]  # stop the run or its upstream attempt (may return an awaitable)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    answered: asyncio.Event | None = None  # a held session: set once `answer` gave status and body

    @classmethod
    def held(cls, abort: Callable[[], object]) -> "RelaySession":
        """A session registered when the hold starts; the answer comes later."""
        return cls(None, "", [], None, abort, answered=asyncio.Event())

    def answer(self, status: int, reason: str, headers: list[tuple[bytes, bytes]],
               body: Callable[[], AsyncIterator[bytes]]) -> None:
        self.status, self.reason, self.headers, self.body = status, reason, headers, body
        if self.answered is not None:
            self.answered.set()

    @property
    def is_answered(self) -> bool:
        return self.answered is None or self.answered.is_set()


class Relay:
    def __init__(self, head_timeout: float = HEAD_TIMEOUT, body_timeout: float = BODY_TIMEOUT,
                 linger: float = LINGER) -> None:
        self.head_timeout, self.body_timeout, self.linger = head_timeout, body_timeout, linger
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
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=_MAX_HEAD)
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
        task.add_done_callback(_log_failure)

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
        # asyncio would log any exception escaping this task as an unhandled error, with a
        # traceback: expected ends are a debug line, and only a bug is an error.
        try:
            await self._exchange(reader, writer)
        except Refused as refused:
            log.debug("relay: %s; %s", refused, f"answered {refused.answer.decode()}" if refused.answer else "closing")
            if refused.answer:
                await self._refuse(reader, writer, refused.answer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            # the reader left or reset, or the upstream broke (UpstreamBroken)
            log.debug("relay: connection ended: %r", exc)
        except Exception:  # noqa: BLE001 - logged, not left in the task
            log.error("codex-failover internal error in the relay", exc_info=True)
        finally:
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session, head, length = await self._claim(reader)
        try:
            try:
                await asyncio.wait_for(_discard_body(reader, length), self.body_timeout)
            except TimeoutError:
                raise Refused(f"request body not received within {self.body_timeout:g}s") from None
            self.streaming += 1
            try:
                if isinstance(session, RelaySession):
                    await self._serve(session, reader, writer)
                else:  # a gated WebSocket: it speaks for itself
                    await session.serve(head, reader, writer)
            finally:
                self.streaming -= 1
        finally:
            await _maybe_await(session.abort())

    async def _claim(self, reader: asyncio.StreamReader):
        """The session named by the request's token, the request head, and its body length
        (CHUNKED for a chunked body); Refused otherwise, before any of the body is read."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout)
        except TimeoutError:
            raise Refused(f"no request head within {self.head_timeout:g}s") from None
        except asyncio.IncompleteReadError as exc:
            raise Refused(f"the client left after {len(exc.partial)} bytes, before a request head") from None
        except asyncio.LimitOverrunError:
            raise Refused("request head over 64 KiB", b"431 Request Header Fields Too Large") from None
        target, length = _parse_head(head)
        session = self._sessions.pop(target.removeprefix(b"/r/").decode("latin-1"), None) \
            if target.startswith(b"/r/") else None
        if session is None:
            raise Refused("unknown or reused token", b"403 Forbidden")
        return session, head, length

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> None:
        """Answer, then drain unread input for a moment before closing: closing a socket with
        unread input sends a reset, which can destroy the answer before the client reads it."""
        writer.write(b"HTTP/1.1 %b\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % answer)
        try:
            async with asyncio.timeout(self.linger):
                await writer.drain()
                writer.write_eof()
                while await reader.read(65536):
                    pass
        except (TimeoutError, OSError):
            pass

    async def _serve(self, session: RelaySession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Stream the session until it ends, or until the reader leaves (then stop at once)."""
        loop = asyncio.get_running_loop()
        pump = loop.create_task(self._pump(session, writer))
        gone = loop.create_task(reader.read(1))  # b"" when the reader leaves; it never sends more
        gone.add_done_callback(_retrieve)  # a reset reader fails it, maybe after pump ended
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
        if session.answered is not None:
            await session.answered.wait()  # the hold: the run decides (the reader may leave meanwhile)
        assert session.body is not None  # (given when made, or by `answer` before `answered` is set)
        head = [f"HTTP/1.1 {session.status} {session.reason or 'OK'}".encode()]
        head += [k + b": " + v for k, v in session.headers if k.lower() not in HOP_BY_HOP]
        head += [b"transfer-encoding: chunked", b"connection: close", b"", b""]
        writer.write(b"\r\n".join(head))
        async for chunk in session.body():
            if chunk:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _parse_head(head: bytes) -> tuple[bytes, int]:
    """The request target and body length (CHUNKED for a chunked body); Refused with 400 if the
    head is not HTTP/1.x: the relay never guesses at a malformed request."""
    request_line, *header_lines = head[:-4].split(b"\r\n")
    line = _REQUEST_LINE.fullmatch(request_line)
    if line is None:
        raise Refused(f"malformed request line {request_line[:80]!r}", b"400 Bad Request")
    lengths, codings = set(), []
    for header in header_lines:
        name, colon, value = header.partition(b":")
        if not colon or not _HEADER_NAME.fullmatch(name):
            raise Refused(f"malformed header line {header[:80]!r}", b"400 Bad Request")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not _DECIMAL.fullmatch(value):
                raise Refused(f"malformed content-length {value[:80]!r}", b"400 Bad Request")
            lengths.add(int(value))
        elif name == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",")]
    if codings:  # it overrides any content-length (RFC 9112 6.3); only chunked can be framed
        if codings[-1] != b"chunked":
            raise Refused(f"unframed transfer-encoding {b', '.join(codings)[:80]!r}", b"400 Bad Request")
        return line[1], CHUNKED
    if len(lengths) > 1:
        raise Refused("conflicting content-lengths", b"400 Bad Request")
    return line[1], lengths.pop() if lengths else 0


async def _discard_body(reader: asyncio.StreamReader, length: int) -> None:
    """Read the forwarded request body (the relay never needs it): the next byte mitmproxy sends
    must not be taken for the reader leaving, and closing with unread input would reset."""
    if length != CHUNKED:
        await _skip(reader, length)
        return
    while True:  # chunk-size [; extensions] CRLF, data CRLF ..., 0 CRLF, trailers, CRLF
        size = (await reader.readuntil(b"\r\n"))[:-2].partition(b";")[0].strip()
        if not _HEX.fullmatch(size):
            raise Refused(f"malformed chunk size {size[:80]!r}", b"400 Bad Request")
        if int(size, 16) == 0:
            break
        await _skip(reader, int(size, 16) + 2)
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields
        pass


async def _skip(reader: asyncio.StreamReader, count: int) -> None:
    while count > 0:
        data = await reader.read(min(count, 65536))
        if not data:
            raise asyncio.IncompleteReadError(b"", count)
        count -= len(data)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a task's exception as seen (its end is handled elsewhere)."""
    if not task.cancelled():
        task.exception()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.error("codex-failover internal error in the relay: %r", exc, exc_info=exc)


async def _maybe_await(result) -> None:
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result
