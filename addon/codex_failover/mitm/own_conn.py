"""The attempt engine's fallback (`engine` in mitm/fallbacks.py): one upstream connection per attempt,
dialled and spoken by the addon itself on mitmproxy's public API only.

Used on a mitmproxy release the seam was not tested on, or when forced: an attempt is then not a
stream on a kept connection run by mitmproxy's layers (warm_conn.py) but an HTTP/1.1 exchange of
its own (h11, which mitmproxy brings), over the same dial as the gate's own sockets (ws/upstream.py:
directly, through a route's HTTP CONNECT, or SOCKS through its loopback bridge; TLS with mitmproxy's
upstream trust options). Its flow still runs every addon's hooks by name, in mitmproxy's order
(`requestheaders`, `request`, `responseheaders`, `response` or `error`), so mitmweb, `-w` and other
addons see it; the credential is never on the flow: the head written to the socket carries it, the
flow its placeholders (Attempt.wire_headers). What it costs: a handshake per attempt (no kept or
pre-warmed connection) and HTTP/1.1 upstream; `server_connect`-style hooks are not run.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import h11
from mitmproxy import ctx, flow as mitmflow, hooks, http

from ..net.relay import HOP_BY_HOP
from ..ws.upstream import Target, tunnel

READ = 65536
MAX_BODY = 64 * 1024 * 1024  # a whole (not streamed) answer kept in memory, at most
MAX_HEAD = 1024 * 1024  # a response head, at most
# Not copied from the flow's headers: hop-by-hop ones (the relay's list), and what the head writes itself.
NOT_COPIED = HOP_BY_HOP | {b"te", b"host", b"proxy-authorization"}


def run_hook(hook: hooks.Hook):
    """A flow's hook through every addon, by mitmproxy's own dispatch (as its layers run a flow's hooks)."""
    return ctx.master.addons.handle_lifecycle(hook)


class OwnConnection:
    """One attempt's own upstream connection (the interface warm_conn.WarmConnection offers attempts)."""

    multiplexed = False
    alive = dialling = False

    def __init__(self, endpoint, dial_timeout: float, context):
        self.endpoint, self.dial_timeout, self.context = endpoint, dial_timeout, context
        self.attempts: dict[int, object] = {}
        self._reading = asyncio.Event()
        self._reading.set()
        self._writer: asyncio.StreamWriter | None = None
        self._cancelled: str | None = None
        self._task: asyncio.Task | None = None
        self._started = False  # its task runs (a task cancelled before it started would skip its `finally`)

    async def submit(self, attempt) -> None:
        """Run the attempt to its final hook (in a task of its own; this returns at once)."""
        self.attempts[0] = attempt
        self._task = asyncio.get_running_loop().create_task(self._run(attempt))

    async def cancel(self, attempt, message: str) -> None:
        if self._task is None or self._task.done():
            return
        self._cancelled = message
        attempt.abandoned = not attempt.sent
        if not self._started:
            return  # it sees `_cancelled` as it starts, and ends with its error hook
        if self._writer is not None:
            self._writer.close()
        self._reading.set()
        self._task.cancel()

    def set_reading(self, on: bool) -> None:
        (self._reading.set if on else self._reading.clear)()

    def close(self, why: str = "") -> None:
        if self._writer is not None:
            self._writer.close()

    async def _run(self, attempt) -> None:
        flow = attempt.flow
        flow.live, self._started = True, True
        try:
            if self._cancelled:
                raise asyncio.CancelledError
            await run_hook(hooks.all_hooks["requestheaders"](flow))
            if flow.error is None:
                await run_hook(hooks.all_hooks["request"](flow))
            if flow.error is not None:  # an addon killed it: its error hook, as mitmproxy runs it
                await self._failed(flow, flow.error.msg)
            elif flow.response is not None:  # an addon answered it
                await run_hook(hooks.all_hooks["responseheaders"](flow))
                await run_hook(hooks.all_hooks["response"](flow))
            else:
                await self._exchange(attempt, flow)
                await run_hook(hooks.all_hooks["response"](flow))
        except asyncio.CancelledError:
            await self._failed(flow, self._cancelled or mitmflow.Error.KILLED_MESSAGE)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, h11.ProtocolError, TimeoutError) as exc:
            text = f"timed out connecting after {self.dial_timeout:g}s" if isinstance(exc, TimeoutError) and not attempt.sent \
                else f"{type(exc).__name__}: {exc}"
            await self._failed(flow, text)
        except Exception as exc:  # noqa: BLE001 - ConnectFailed and the like: the message says why
            await self._failed(flow, str(exc) or type(exc).__name__)
        finally:
            flow.live = False
            if self._writer is not None:
                self._writer.close()
            self.attempts.clear()
            attempt.over.set()

    async def _failed(self, flow: http.HTTPFlow, message: str) -> None:
        if flow.error is None:
            flow.error = mitmflow.Error(message)
        await asyncio.shield(run_hook(hooks.all_hooks["error"](flow)))

    async def _exchange(self, attempt, flow: http.HTTPFlow) -> None:
        req = flow.request
        target = Target(req.scheme == "https", req.host, req.port, req.path)
        bridges, tls = self.context()
        if attempt.abandoned or self._cancelled:
            raise asyncio.CancelledError
        reader, self._writer = await asyncio.wait_for(tunnel(target, self.endpoint, bridges, tls), self.dial_timeout)
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        body = req.raw_content or b""
        fields = [(b"host", target.authority.encode())]
        fields += [(k, v) for k, v in attempt.wire_headers().fields if k.lower() not in NOT_COPIED and not k.startswith(b":")]
        fields.append((b"content-length", str(len(body)).encode()))
        self._writer.write(conn.send(h11.Request(method=req.method, target=req.path, headers=fields))
                           + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await self._writer.drain()
        attempt.mark_sent()
        buffered = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                await self._reading.wait()
                data = await reader.read(READ)
                if not data and conn.their_state is not h11.SEND_BODY:
                    raise ConnectionError("server closed the connection before the response ended")
                conn.receive_data(data)  # b"": h11 ends a body delimited by the close, or says it was cut
            elif isinstance(event, h11.InformationalResponse):
                continue
            elif isinstance(event, h11.Response):
                flow.response = http.Response(b"HTTP/1.1", event.status_code, event.reason or b"",
                                              http.Headers([(k, v) for k, v in event.headers.raw_items()]),
                                              None, None, time.time(), None)
                await run_hook(hooks.all_hooks["responseheaders"](flow))
                _unless_killed(flow)
            elif isinstance(event, h11.Data):
                assert flow.response is not None  # (h11 gives the head first)
                stream = flow.response.stream
                if callable(stream):
                    stream(bytes(event.data))
                    _unless_killed(flow)
                elif len(buffered) + len(event.data) > MAX_BODY:
                    raise ConnectionError(f"response body over {MAX_BODY >> 20} MiB")
                else:
                    buffered += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert flow.response is not None  # (h11 gives the head first)
                stream = flow.response.stream
                if callable(stream):
                    stream(b"")
                flow.response.data.content = b"" if stream else bytes(buffered)
                flow.response.timestamp_end = time.time()
                return
            else:
                raise ConnectionError("server closed the connection")


def _unless_killed(flow: http.HTTPFlow) -> None:
    """An addon (or mitmweb) killed the flow meanwhile: the attempt ends as a cancelled one."""
    if flow.error is not None:
        raise ConnectionAbortedError(flow.error.msg)

