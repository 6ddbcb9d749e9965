"""One upstream try of a held request: a copy of the client's flow, sent over a warm connection.

The attempt is a complete mitmproxy flow: mitmproxy's HTTP layers run it with every addon hook
(warm_conn.py), so mitmweb shows it and `-w` saves it. Its response reaches the request's driver
through an asyncio queue fed from those hooks and from a stream callable set in `responseheaders`
(called once per chunk, and with b"" at the end).

What mitmweb shows and `-w` saves is the flow object itself, at every moment: secrets are kept
off it. The flow holds placeholders from the start; the real values are on it only while the
upstream connection's layers write the request head (warm_conn._ArmingHttpLayer), never while a
hook or any other code runs. Each attempt's verdict (mark, comment, error) is on the flow before
its final hook returns, so saved flows carry it (docs/observability.md, "mitmweb").
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

from mitmproxy import ctx, flow as mitmflow, hooks, http

from ..core.codex_request import held_as_stream
from ..core.routes import Endpoint
from ..core.warm_book import WarmKey
from .secret_guard import arming
from .warm_conn import WarmConnection, server_at

ATTEMPT_TAG = "codex_failover.attempt"
CAPTURE_LIMIT = 64 * 1024  # opening bytes kept on the attempt flow for mitmweb
# Never on a stored flow: the wire gets the real values (see the module docstring).
SECRET_HEADERS = ("authorization", "cookie", "chatgpt-account-id", "proxy-authorization", "x-api-key", "api-key")
PLACEHOLDER = "<redacted by codex-failover>"
JUDGE_WAIT = 5.0  # longest a final hook waits for the run's verdict (never hangs the replay)
# A stream's last event: once relayed, the client has the whole answer (Codex over HTTP/2 then
# resets its stream at once, which cancels the winner before its upstream's final chunk). Matched as
# the JSON string alone, so `"type": "response.completed"` (JSON written with spaces) counts too; a
# text that mentions it has its quotes escaped (`\"response.completed\"`) and does not match.
TERMINAL_MARKERS = (b'"response.completed"', b'"response.failed"', b'"response.incomplete"')
_MARKER_SPAN = max(map(len, TERMINAL_MARKERS))
# Backpressure: past HIGH bytes queued and not yet taken (a client reading slower than the upstream
# sends), reading from the upstream pauses until the queue is down to LOW. docs/architecture.md.
QUEUE_HIGH = 1024 * 1024
QUEUE_LOW = 256 * 1024

# Queue items
HEAD = "head"  # the response head arrived (flow.response has status and headers)
CHUNK = "chunk"
END = "end"  # the body ended (streamed) or the complete response is in flow.response
ERROR = "error"  # the attempt failed; flow.error.msg says why


def secrets_in(headers: http.Headers) -> list[str]:
    """The SECRET_HEADERS that `headers` has (one pass over them; `in headers` is a scan each)."""
    present = {k.lower() for k, _ in headers.fields}
    return [name for name in SECRET_HEADERS if name.encode() in present]


def hide_secrets(request: http.Request) -> None:
    """Placeholders for the secret headers of a request that mitmweb shows and `-w` saves."""
    for name in secrets_in(request.headers):
        request.headers.set_all(name, [PLACEHOLDER])


M = TypeVar("M", http.Request, http.Response)


def copy_request(message: M) -> M:
    """`message.copy()` (a request, or a response) at a fifth of its cost (~7 against ~37 us):
    mitmproxy's copy serialises the message and builds it again, type-checking every field. Its state
    is its `data`, whose fields are immutable but for the headers and trailers (replay notes §11);
    nothing else is carried over (not `stream`, which another addon may have set)."""
    new = object.__new__(type(message))
    new.data = copy.copy(message.data)
    new.data.headers = message.data.headers.copy()
    if message.data.trailers is not None:
        new.data.trailers = message.data.trailers.copy()
    return new


async def end_unsent(flow: http.HTTPFlow, message: str) -> None:
    """The hooks mitmproxy runs for a request whose connection failed, in its order: for an attempt
    cancelled before it was handed to a connection (not one byte of it left)."""
    addons = ctx.master.addons  # mitmproxy's own dispatch, as its layers run a flow's hooks
    await addons.handle_lifecycle(hooks.all_hooks["requestheaders"](flow))
    await addons.handle_lifecycle(hooks.all_hooks["request"](flow))
    flow.error = mitmflow.Error(message)
    await addons.handle_lifecycle(hooks.all_hooks["error"](flow))


class Capture:
    """The opening bytes of a streamed body (bounded), kept to show on its flow in mitmweb: a
    streamed response has no content of its own, and mitmweb cannot show (or serve) none.

    Once kept on its message (the flow's final hook), the capture holds no buffer of its own: the
    message's stream attribute keeps the Capture for as long as the flow lives (mitmweb's view, or
    until a collection frees a finished connection), and a second copy of up to 64 KiB per flow
    was the largest thing a finished held stream left behind."""

    def __init__(self, limit: int = CAPTURE_LIMIT, on_first=None):
        self.data, self.limit = bytearray(), limit
        self.on_first = on_first  # called once, as the first chunk goes to the client
        self._kept: bytes | None = None  # what went on the message, once kept

    def __call__(self, chunk: bytes) -> bytes:  # a mitmproxy stream callable
        if self.on_first is not None:
            self.on_first, on_first = None, self.on_first
            on_first()
        if len(self.data) < self.limit:
            self.data += chunk[: self.limit - len(self.data)]
        return chunk

    def keep_on(self, response: http.Message | None) -> None:
        """The bytes captured become `response`'s content (the same bytes again if called twice);
        the capture's own buffer goes, and nothing more is kept."""
        if response is not None:
            if self._kept is None:
                self._kept, self.data, self.limit = bytes(self.data), bytearray(), 0
            response.raw_content = self._kept


class Connections(Protocol):
    """Where an attempt's connection comes from: the engine (engine.WarmConnections), which makes the
    attempts, so an attempt knows it only as this."""

    def connection_for(self, key: WarmKey, endpoint: object = None, dial_timeout: float = 30.0) -> WarmConnection:
        """The connection an attempt goes to (counted on it until it is released)."""

    def own_connection(self, key: WarmKey, endpoint: object = None) -> WarmConnection:
        """A connection outside the book, for one WebSocket upgrade (closed with its socket)."""


@dataclass
class Item:
    kind: str
    data: bytes = b""


class Attempt:
    """One replayed copy of the client's request, streaming into an asyncio queue."""

    direct = False  # True for attempt 1 riding the client's own stream (direct.py): no hooks feed it

    def __init__(self, client_flow: http.HTTPFlow, request: http.Request, label: str, n: int, warm: Connections,
                 server=None):
        self.warm = warm  # the engine: where the attempt's connection comes from
        # A new flow for `request`, on the client's connection (shown as its client in mitmweb); not a
        # copy of the client flow, which would copy its connections and certificates each time.
        self.flow = http.HTTPFlow(client_flow.client_conn, server or server_at((request.host, request.port)))
        self.flow.request = request
        self.flow.is_replay = "request"
        self.flow.metadata[ATTEMPT_TAG] = label
        self.n = n
        self.endpoint: Endpoint | None = None  # the route endpoint this attempt goes through, if any
        self.account = ""  # the credential it carries (its health key): its kept connection is that credential's
        self.connected = False  # the way to the upstream is up (TCP, any tunnel, TLS): the request head left
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self._stashed: Item | None = None  # see next_batch
        self.streaming = False
        self.wants_stream = False  # the request asked to stream: a 2xx answer is SSE whatever its Content-Type
        self.captured = Capture()
        self.started = time.monotonic()
        self.conn: WarmConnection | None = None  # the connection it was sent on, once handed over
        self.stream_id = 0  # its stream on that connection
        self.over = asyncio.Event()  # its final hook (response or error) ran
        self._abandon = asyncio.Event()  # cancelled before it was handed to a connection
        self.abandoned = False  # cancelled while waiting for its connection: it never gets it
        self.dial_timeout = 30.0  # a dial for it that hangs is stopped after this (the policy's connect_timeout)
        self._task: asyncio.Task | None = None
        self._wire: dict[str, list[str]] = {}  # secret headers' real values, for the wire only
        self._armed = self._redacted = False  # the real values are on the flow now / placeholders went on once
        self.sent = False  # the request head was written: the real values are never needed again
        self.on_sent: Callable[[], object] | None = None  # once the head was written (the driver's `dispatched`)
        self.judged = asyncio.Event()  # the run has put its verdict on the flow
        self.verdict_error: str | None = None  # the flow's error once it ends, for a loser
        self.finished = False  # the whole response arrived
        self.queued = 0  # chunk bytes in the queue, not yet taken
        self.saw_terminal = False  # the stream's terminal event arrived (the answer is whole)
        self._tail = b""  # the end of the last chunk, for a marker split across chunks
        self._paused = False  # reading from the upstream is paused (backpressure)

    def start(self, via=None) -> None:
        """Send it. The request's URL and headers must be final: the target is read now. `via`:
        an upstream proxy for this attempt only, `(scheme, (host, port))`."""
        self.flow.request.headers.pop("proxy-authorization", None)  # the client's, for this proxy: never upstream
        self._hide_secrets()
        req = self.flow.request
        if self.flow.server_conn.address != (req.host, req.port):  # changed since the flow was made
            self.flow.server_conn = server_at((req.host, req.port))
        self.flow.server_conn.via = via
        key = WarmKey(req.scheme, req.host, req.port, via, self.account)
        self._task = asyncio.get_running_loop().create_task(self._send(key))

    async def _send(self, key: WarmKey) -> None:
        """Hand the request to its connection (warm, being dialled, or dialled for it) and wait for
        its end. mitmproxy's layers run its hooks, then send it once the connection is up."""
        if self._abandon.is_set():  # cancelled before it started: not one byte left
            return await end_unsent(self.flow, mitmflow.Error.KILLED_MESSAGE)
        self.conn = self.warm.connection_for(key, self.endpoint, self.dial_timeout)
        await self.conn.submit(self)
        await self.over.wait()


    # -- called from the addon's hooks for this attempt's flow (synchronous) ---------------

    def _hide_secrets(self) -> None:
        headers = self.flow.request.headers
        for name in secrets_in(headers):
            self._wire[name] = headers.get_all(name)
        arming(v for values in self._wire.values() for v in values)  # masked in any log (secret_guard.py)
        self.redact()

    def mark_sent(self) -> None:
        """From the connection's layers (synchronous): the request head was written."""
        self.sent = self.connected = True
        if self.on_sent is not None:
            self.on_sent()

    def arm(self) -> None:
        """The real values on the flow, for one synchronous step of the protocol layers only."""
        for name, values in self._wire.items():
            self.flow.request.headers.set_all(name, values)
        self._armed = True

    def wire_headers(self) -> http.Headers:
        """The request's headers as the wire gets them (the real values): for the engine's fallback,
        which writes the head itself (own_conn.py)."""
        headers = self.flow.request.headers.copy()
        for name, values in self._wire.items():
            headers.set_all(name, values)
        return headers

    def redact(self) -> None:
        if self._armed or not self._redacted:
            hide_secrets(self.flow.request)
            self._armed, self._redacted = False, True

    def judge(self, mark: str, comment: str, error: str | None) -> None:
        """The run's verdict on this attempt, shown in mitmweb and saved with the flow."""
        self.flow.marked, self.flow.comment, self.verdict_error = mark, comment, error
        response = self.flow.response
        if error is not None and response is not None and response.timestamp_end is None:
            response.timestamp_end = time.time()  # the loser ends here (mitmweb shows it as still running otherwise)
        # A loser shows why it lost, also one whose whole answer came before the verdict (its `response`
        # hook waits for this): mitmweb would otherwise show a rejected attempt without an error.
        if error is not None and (self.flow.error is not None or self.finished):
            self.flow.error = mitmflow.Error(error)
        self.judged.set()

    async def _judged(self) -> None:
        try:
            await asyncio.wait_for(self.judged.wait(), JUDGE_WAIT)
        except TimeoutError:
            pass

    def _keep_capture(self) -> None:
        """What arrived (bounded) stays on the flow, so mitmweb shows it: the live body went elsewhere.
        The flow keeps no way back to the attempt (its stream callable): a finished attempt is freed by
        reference counting, not by the collector."""
        if self.streaming:
            self.captured.keep_on(self.flow.response)
            if self.flow.response is not None and self.flow.response.stream == self._on_chunk:
                self.flow.response.stream = True  # (streamed, as it was; nothing more comes)

    def on_responseheaders(self, stream: bool) -> None:
        self.redact()
        self.streaming = stream
        if stream:
            assert self.flow.response is not None  # (its head arrived)
            self.flow.response.stream = self._on_chunk
        self.queue.put_nowait(Item(HEAD))

    def _on_chunk(self, data: bytes) -> bytes:
        if data:
            self.captured(data)
            if not self.saw_terminal:  # no copy of the chunk: only its edge joins the previous one's
                seam = self._tail + data[:_MARKER_SPAN]
                self.saw_terminal = any(m in data or m in seam for m in TERMINAL_MARKERS)
                self._tail = data[-_MARKER_SPAN:]
            self.queue.put_nowait(Item(CHUNK, data))
            self.queued += len(data)
            if self.queued > QUEUE_HIGH:  # again each time: asyncio's StreamReader may have resumed it
                self.set_reading(False)
        return data

    def _took(self, item: Item) -> Item:
        if item.kind == CHUNK:
            self.queued -= len(item.data)
            if self._paused and self.queued <= QUEUE_LOW:
                self.set_reading(True)
        return item

    @property
    def paused(self) -> bool:
        return self._paused

    def set_reading(self, on: bool) -> None:
        """Pause or resume reading the upstream socket: TCP's window then slows the upstream down,
        as mitmproxy's own streaming does. (The relay drains its writes to the client.)"""
        self._paused = not on
        conn = self.conn
        # An HTTP/2 connection shared with other attempts is never paused (docs/architecture.md#known-limits);
        # resuming is always safe.
        if conn is not None and (on or not conn.multiplexed or len(conn.attempts) <= 1):
            conn.set_reading(on)

    async def on_response(self) -> None:
        """The final hook of an attempt that ended on its own: waits (bounded) for the verdict."""
        self.finished = True
        self.redact()
        self._keep_capture()
        self.queue.put_nowait(Item(END))
        await self._judged()

    async def on_error(self) -> None:
        self.redact()
        self._keep_capture()
        self.queue.put_nowait(Item(ERROR, (self.flow.error.msg if self.flow.error else "error").encode()))
        await self._judged()
        if self.verdict_error is not None:  # the verdict, not the protocol error the cancel caused
            self.flow.error = mitmflow.Error(self.verdict_error)
        elif self.saw_terminal and self.judged.is_set():
            # A winner stopped after its whole answer went out (the client closed at once): no error.
            self.flow.error = None
            if self.flow.response is not None and self.flow.response.timestamp_end is None:
                self.flow.response.timestamp_end = time.time()

    # -- used by the request handler ---------------------------------------------------------

    async def next(self, timeout: float | None) -> Item | None:
        """The next item, or None when `timeout` seconds pass first."""
        if not self.queue.empty():  # already there: no timer, no future
            return self._took(self.queue.get_nowait())
        try:
            return self._took(await asyncio.wait_for(self.queue.get(), timeout))
        except TimeoutError:
            return None

    async def next_batch(self) -> Item:
        """The relay's read: every chunk already waiting, joined (under load, one write through
        mitmproxy instead of many), or the end/error item once no chunk is left."""
        item = self._stashed or self._took(await self.queue.get())
        self._stashed = None
        if item.kind != CHUNK or self.queue.empty():
            return item
        parts = [item.data]
        while not self.queue.empty():
            following = self._took(self.queue.get_nowait())
            if following.kind != CHUNK:  # END/ERROR come last: keep it for the next call
                self._stashed = following
                break
            parts.append(following.data)
        return Item(CHUNK, b"".join(parts))

    async def cancel(self, timeout: float = 5.0) -> None:
        """Stop the attempt (its HTTP/2 stream is reset; an HTTP/1.1 connection closes); idempotent.
        An attempt whose whole response arrived is left to finish (no error on a winner)."""
        self.judged.set()  # the verdict, if any, is on the flow: the final hook need not wait
        if self._task is None or self._task.done():
            return
        if not self.finished:
            if self.conn is None:
                self._abandon.set()
            else:
                await self.conn.cancel(self, "attempt cancelled by codex-failover")
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()


class AttemptHooks:
    """A nested addon of FailoverAddon: an attempt flow's response hooks feed its Attempt."""

    def __init__(self, attempts: dict[str, Attempt]):
        self.attempts = attempts  # attempt flow id -> Attempt (the driver adds them)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        attempt = self.attempts.get(flow.id)
        if attempt is not None and not attempt.direct and flow.response is not None:  # (it is, in this hook)
            attempt.on_responseheaders(held_as_stream(flow.response.status_code, flow.response.headers.get("content-type"),
                                                      attempt.wants_stream))

    def response(self, flow: http.HTTPFlow):
        """(An awaitable for an attempt's own flow only: any other flow's hook needs no coroutine.)"""
        attempt = self.attempts.pop(flow.id, None)
        if attempt is not None and not attempt.direct:
            return attempt.on_response()
        return None

    def error(self, flow: http.HTTPFlow):
        attempt = self.attempts.pop(flow.id, None)
        if attempt is not None and not attempt.direct:
            return attempt.on_error()
        return None
