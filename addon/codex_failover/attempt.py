"""The attempt engine: one upstream try of a held request, as a mitmproxy client replay.

This is the only module that touches `mitmproxy.addons.clientplayback.ReplayHandler`, a
semi-internal class (hence the exact mitmproxy pin). Verified against 12.3.1:
- `ReplayHandler(flow, options)` connects to `flow.request`'s host/port when constructed, runs
  every addon hook for the copy, and `replay()` returns after the copy's `response`/`error` hook;
- a stream callable set in `responseheaders` is called once per chunk and with b"" at the end;
- cancelling needs both `flow.kill()` (before the connection exists) and cancelling the
  handler's transport tasks (mid-stream; `kill()` alone does not stop a streaming response).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from mitmproxy import ctx, http
from mitmproxy.addons.clientplayback import ReplayHandler
from mitmproxy.connection import Server

from .quiet_log import replay_level

ATTEMPT_TAG = "codex_failover.attempt"
CAPTURE_LIMIT = 64 * 1024  # opening bytes kept on the attempt flow for mitmweb

# Queue items
HEADERS = "headers"  # the response head arrived (flow.response has status and headers)
CHUNK = "chunk"
END = "end"  # the body ended (streamed) or the complete response is in flow.response
ERROR = "error"  # the attempt failed; flow.error.msg says why


class _AttemptReplay(ReplayHandler):
    """mitmproxy's replay handler, its per-connection INFO lines lowered to DEBUG (quiet_log.py)."""

    def log(self, message: str, level: int = logging.INFO, exc_info=None) -> None:
        super().log(message, replay_level(level, ctx.options.failover_verbose), exc_info)


@dataclass
class Item:
    kind: str
    data: bytes = b""


class Attempt:
    """One replayed copy of the client's request, streaming into an asyncio queue."""

    def __init__(self, client_flow: http.HTTPFlow, label: str, n: int):
        self.flow = client_flow.copy()
        # The client flow may already be answered by the relay (heartbeat mode): an attempt starts clean.
        self.flow.response, self.flow.error = None, None
        self.flow.metadata.clear()
        self.flow.is_replay = "request"
        self.flow.metadata[ATTEMPT_TAG] = label
        self.n = n
        self.endpoint = None  # the route endpoint (routes.Endpoint) this attempt goes through, if any
        self.connected = False  # the way to the upstream is up (TCP, and the tunnel and TLS for https)
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self._stashed: Item | None = None  # see next_batch
        self.streaming = False
        self.captured = bytearray()
        self.started = time.monotonic()
        self._handler: _AttemptReplay | None = None
        self._task: asyncio.Task | None = None

    def start(self, via=None) -> None:
        """Send it. The request's URL and headers must be final: the target is read now. `via`:
        an upstream proxy for this attempt only, `(scheme, (host, port))`."""
        self.flow.server_conn = Server(address=(self.flow.request.host, self.flow.request.port))
        self.flow.server_conn.via = via
        self._handler = _AttemptReplay(self.flow, ctx.options)
        self._task = asyncio.get_running_loop().create_task(self._handler.replay())

    # -- called from the addon's hooks for this attempt's flow (synchronous) ---------------

    def redact(self) -> None:
        """Once the request is on the wire, the flow (shown in mitmweb, maybe saved) keeps no secret."""
        for name in ("authorization", "cookie"):
            if name in self.flow.request.headers:
                self.flow.request.headers[name] = "<redacted by codex-failover>"

    def on_responseheaders(self, stream: bool) -> None:
        self.redact()
        self.streaming = stream
        if stream:
            self.flow.response.stream = self._on_chunk
        self.queue.put_nowait(Item(HEADERS))

    def _on_chunk(self, data: bytes) -> bytes:
        if data:
            if len(self.captured) < CAPTURE_LIMIT:
                self.captured += data[: CAPTURE_LIMIT - len(self.captured)]
            self.queue.put_nowait(Item(CHUNK, data))
        return data

    def on_response(self) -> None:
        if self.streaming:
            # Make the opening bytes visible in mitmweb; the live body went to the relay.
            self.flow.response.content = bytes(self.captured)
        self.queue.put_nowait(Item(END))

    def on_error(self) -> None:
        self.redact()
        self.queue.put_nowait(Item(ERROR, (self.flow.error.msg if self.flow.error else "error").encode()))

    # -- used by the request handler ---------------------------------------------------------

    async def next(self, timeout: float | None) -> Item | None:
        """The next item, or None when `timeout` seconds pass first."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None

    async def next_batch(self) -> Item:
        """The relay's read: every chunk already waiting, joined (under load, one write through
        mitmproxy instead of many), or the end/error item once no chunk is left."""
        item = self._stashed or await self.queue.get()
        self._stashed = None
        if item.kind != CHUNK or self.queue.empty():
            return item
        parts = [item.data]
        while not self.queue.empty():
            following = self.queue.get_nowait()
            if following.kind != CHUNK:  # END/ERROR come last: keep it for the next call
                self._stashed = following
                break
            parts.append(following.data)
        return Item(CHUNK, b"".join(parts))

    async def cancel(self, timeout: float = 5.0) -> None:
        """Stop the attempt and close its upstream connection; idempotent."""
        if self._task is None or self._task.done():
            return
        if self.flow.killable:
            self.flow.kill()
        for io in list(self._handler.transports.values()):
            if io.handler is not None:
                io.handler.cancel("attempt cancelled by codex-failover")
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()

    def owns(self, client) -> bool:
        """Is `client` (of a connection hook or a CONNECT flow) this attempt's? Each handler has
        its own copy of the client connection."""
        return self._handler is not None and self._handler.client.id == client.id

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()
