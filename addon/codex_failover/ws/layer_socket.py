"""A gated WebSocket's upstream socket on mitmproxy's own layers, as an HTTP attempt is sent.

The upgrade is an attempt (mitm/attempt.py) on a connection of its own (mitm/warm_conn.py): mitmproxy's
`HttpStream` runs it with every addon's hooks and dials it (the credential's route, mitmproxy's
upstream TLS options, map_remote and the like apply), and once the upstream accepts, mitmproxy's
WebSocket layer runs the socket, so every addon sees its messages and mitmweb and `-w` show it.

The gate is the socket's client side, with the interface of ws/conn.WsConn (which stays as the
fallback, `CODEX_FAILOVER_FALLBACK=wsleg`):
- what the gate sends goes into the layer as a whole message (`send`): its hooks run and mitmproxy's
  layer frames it once toward the upstream (the seam's `WarmConnection.send_message`);
- what the upstream sends is taken in the `websocket_message` hook and dropped there, so nothing
  goes on to the client side; pings reach it as frames (`from_layers`) and are answered;
- `close` sends a close frame from the client side, and mitmproxy closes both.

Bounded: the bytes read since the upstream's last whole message are counted (`received`), and a
compressed socket inflates through BoundedDeflate, so a message past `upstream_max()` closes the
socket with 1009; reading pauses while a message's hooks run, and past QUEUE_HIGH bytes the gate has
not taken; more than PINGS_PER_SECOND pings close it with 1008. What mitmweb shows is masked before
other addons see it; the flow keeps KEEP bytes of messages (leg.FlowRecord).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from mitmproxy import flow as mitmflow, http, websocket
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import CloseConnection, Ping
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import split_comma_header

from ..core.transport import classify_connection_error
from ..core.ws_turns import Message
from ..mitm.attempt import ATTEMPT_TAG, QUEUE_HIGH, QUEUE_LOW, Attempt, copy_request, end_unsent
from .bounded_deflate import BoundedDeflate
from .conn import ABNORMAL, MESSAGE_TOO_BIG, HandshakeRejected, WsConn
from .leg import FlowRecord, hide_added, mask, masked_body
from .upstream import ConnectFailed

log = logging.getLogger("codex_failover")

REJECTION_BODY = 65536  # of a refused upgrade's body, kept to classify and show
UPSTREAM_MAX = 16 * 1024 * 1024  # an upstream message larger than this closes the socket (1009)
PINGS_PER_SECOND = 100  # more from an upstream closes its socket (1008)
POLICY_VIOLATION = 1008
CLOSE_GRACE = 5.0  # after our close frame, the connection is closed if mitmproxy has not yet


class LayerSocket(Attempt):
    """One upstream socket of a gated session (see the module's docstring)."""

    def __init__(self, client_flow: http.HTTPFlow, url: str, headers: http.Headers, label: str, title: str, engine):
        request = copy_request(client_flow.request)
        request.headers = headers
        request.url = url  # after the headers: the URL's host becomes the Host header's (as attempt_maker does)
        super().__init__(client_flow, request, label, 0, engine)
        self.flow.live = True  # addons such as map_remote act on live flows only
        self.record = FlowRecord(self.flow, title)
        self.verdict: Callable[[BaseException], tuple[str, str]] | None = None  # at a failed upgrade's final hook: (mark, line)
        self.failure: BaseException | None = None
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.close_code: int | None = None
        self.close_reason = ""
        self.upgraded = asyncio.Event()  # websocket_start ran
        self.sent_or_over = asyncio.Event()
        self.on_sent = self.sent_or_over.set
        self.inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self._client: ClientSide | None = None  # the gate's end of the inside hop, once upgraded
        self._unread = 0  # bytes read since the upstream's last whole message
        self._body = bytearray()  # a refused upgrade's
        self._grace: asyncio.TimerHandle | None = None  # closes the connection if the close handshake hangs
        self._raw: tuple[bytes, bytes] | None = None  # the message being hooked: as it came, as others see it

    # -- the gate's side (WsConn's interface) ------------------------------------------------

    async def opened(self, connect_timeout: float) -> None:
        """Wait for the upgrade: return once the socket is open, or raise as ws/upstream.open_upstream
        does (ConnectFailed before the head left, HandshakeRejected, ConnectionError or TimeoutError)."""
        for phase in ("connect", "answer"):
            waiting = self.sent_or_over if phase == "connect" else self.upgraded
            try:
                await asyncio.wait_for(_either(waiting, self.over), connect_timeout)
            except TimeoutError:
                self.failure = (ConnectFailed("pre_dispatch", f"timed out connecting after {connect_timeout:g}s")
                                if phase == "connect" else TimeoutError("no answer to the WebSocket upgrade"))
                await self.stop()
                raise self.failure from None
            if self.upgraded.is_set():
                return
            if self.over.is_set():
                self.abort()
                raise self.failure or self._failed()

    async def recv(self) -> Message | None:
        item = await self.inbox.get()
        if item is None:
            self.inbox.put_nowait(None)  # every later read sees the end too
            return None
        self.queued -= len(item[0])
        if self._paused and self.queued <= QUEUE_LOW:
            self.set_reading(True)
        return item

    async def send(self, message: Message) -> None:
        """A message for the upstream: into the WebSocket layer whole, framed once there (no frames of ours)."""
        content, is_text = message
        if not self.open or self._client is None or self.conn is None:
            return
        async with self._client.writing:  # in order with the client side's control frames
            await self.conn.send_message(self, content, is_text)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the socket (a close frame from the client side; mitmproxy closes both). Never raises."""
        if not self.open:
            return  # closed already (by us: the close handshake has its grace; by the upstream: it is going)
        self._closed(code, reason)
        if self._client is None:
            self.abort()
            return
        try:
            frame = self._client.ws.send(CloseConnection(code=code, reason=reason))
        except Exception:  # noqa: BLE001 - a code the protocol does not send: the connection goes
            self.abort()
            return
        asyncio.get_running_loop().create_task(self._client.write(frame))
        self._grace = asyncio.get_running_loop().call_later(CLOSE_GRACE, self.abort)  # cancelled at the end

    async def stop(self) -> None:
        """Stop an upgrade under way: its connection closed (a dial in progress too), its flow ended."""
        self.abort()
        await self.cancel(timeout=1.0)

    def abort(self) -> None:
        """Close the connection now (no close handshake); idempotent. A reader waiting gets the end."""
        self._closed(ABNORMAL, "connection closed")
        self.inbox.put_nowait(None)
        if self.conn is not None:
            self.conn.close("closed by codex-failover")

    @property
    def open(self) -> bool:
        return self.close_code is None

    def message(self, content: bytes, is_text: bool, from_client: bool) -> None:
        """(As ws/leg.Leg's; here its messages are recorded from the hooks.)"""

    def judge_socket(self, mark: str, line: str, update: bool = True) -> None:
        self.record.judge(mark, line, update)

    # -- from the connection's layers (synchronous) -------------------------------------------

    async def _send(self, key) -> None:
        if self._abandon.is_set():  # cancelled before it started: not one byte left
            await end_unsent(self.flow, mitmflow.Error.KILLED_MESSAGE)
            self.over.set()
            return
        self.conn = self.warm.own_connection(key, self.endpoint)
        await self.conn.submit(self, socket=self)
        try:
            await self.over.wait()
        finally:
            self.sent_or_over.set()
            self.inbox.put_nowait(None)  # (once the socket is over, nothing more comes)
            if self._grace is not None:  # (its handle would keep this socket, and its layers, 5 s longer)
                self._grace.cancel()
                self._grace = None

    def hooked(self, name: str, before: bool) -> None:
        """Each hook of the flow, before and after every addon ran it."""
        response = self.flow.response
        if before:
            if name == "websocket_message":
                self._mask_for_others()
                if not _socket_of(self.flow).messages[-1].from_client and self.conn is not None:
                    self.conn.set_reading(False)  # nothing more is read while its hooks run (bounded by one read)
            elif name in ("response", "error") and not (response is not None and self.flow.websocket is not None):
                self._final()
            return
        if name == "request":
            hide_added(self.flow.request, self._wire)  # the flow as redacted, the wire's values kept
        elif name == "responseheaders" and response is not None and response.status_code != 101:
            response.stream = self._collect
        elif name == "websocket_start":
            self._start_socket()
        elif name == "websocket_message":
            self._took_message()
        elif name == "websocket_end":
            ws = _socket_of(self.flow)
            self._closed(ws.close_code or ABNORMAL, ws.close_reason or "")
            self.flow.live = False
            self.inbox.put_nowait(None)
            # Its zlib state (some 300 KB) goes now: mitmproxy's layers wait in reference cycles
            # for the next full collection (docs/architecture.md#memory).
            if self.conn is not None:
                (self.conn.extensions(self, "server") or []).clear()

    def received(self, n: int) -> None:
        self._unread += n
        if self._unread > upstream_max() + 65536 and self.open:  # one read past the largest message
            self.close(MESSAGE_TOO_BIG, "message too big")

    def from_layers(self, data: bytes) -> None:
        """Frames mitmproxy sends the client side: its pings are answered; the rest is the end."""
        if self._client is not None and self.open and not self._client.received(data):
            log.warning("[%s] the upstream sent more than %d pings a second: its socket is closed",
                        self.flow.metadata.get(ATTEMPT_TAG, "?"), PINGS_PER_SECOND)
            self._closed(POLICY_VIOLATION, "too many pings")
            self.abort()

    async def _feed(self, data: bytes) -> None:
        if self.conn is not None and data:
            await self.conn.feed(self, data)

    def _collect(self, chunk: bytes) -> bytes:
        """A refused upgrade's body (a stream callable): the first REJECTION_BODY bytes are kept."""
        if len(self._body) < REJECTION_BODY:
            self._body += chunk[: REJECTION_BODY - len(self._body)]
        return b""

    def _final(self) -> None:
        """A failed upgrade's last hook: what it got on the flow, its verdict before any addon saves it."""
        response = self.flow.response
        if response is not None and response.status_code != 101:
            response.stream = False
            if not self._body and response.raw_content:  # an addon's answer, whole (not streamed)
                self._body = bytearray(response.raw_content[:REJECTION_BODY])
            encoding = response.headers.pop("content-encoding", None)  # shown decoded
            response.content = masked_body(bytes(self._body), encoding)
        self.failure = self._failed()
        if self.verdict is not None:
            mark, line = self.verdict(self.failure)
            self.record.judge(mark, line, update=False)
        self.redact()
        self.flow.live = False

    def _failed(self) -> BaseException:
        response = self.flow.response
        if response is not None and response.status_code != 101:
            return HandshakeRejected(response.status_code, list(response.headers.fields), bytes(self._body))
        message = self.flow.error.msg if self.flow.error is not None else "upstream closed during the WebSocket handshake"
        if self.abandoned or message == mitmflow.Error.KILLED_MESSAGE:
            return ConnectFailed("pre_dispatch", message)
        if not self.sent:
            return ConnectFailed(classify_connection_error(message, response_started=False), message)
        return ConnectionError(message)

    def _start_socket(self) -> None:
        """The upgrade was accepted: the client side's frames, and the upstream's inflate bounded."""
        self.redact()
        response = self.flow.response
        assert response is not None  # (the 101's)
        self.response_headers = list(response.headers.fields)
        theirs = self.conn.extensions(self, "server") if self.conn is not None else None
        _bound_inflate(theirs or [])
        inside = self.conn.extensions(self, "client") if self.conn is not None else None
        if inside is not None:  # the hop inside the process: no compression (no zlib state, no double work)
            inside.clear()
            ours = []
        else:  # mitmproxy's layers are not as tested: speak what the upstream's 101 accepted, as they do
            ours = _deflate_as_accepted(response.headers.get("sec-websocket-extensions", ""))
            if ours:
                log.warning("codex-failover: the upstream WebSocket's inflate could not be bounded (mitmproxy's "
                            "layers are not as tested); a message past its bound is still closed with 1009")
        self._client = ClientSide(ours, self._feed)
        self.upgraded.set()

    def _mask_for_others(self) -> None:
        """Before other addons see an upstream message (mitmweb's view among them): masked."""
        message = _socket_of(self.flow).messages[-1]
        self._raw = None
        if not message.from_client:
            masked = mask(message.content, message.is_text)
            self._raw = (message.content, masked)
            message.content = masked

    def _took_message(self) -> None:
        """After every addon saw it: an upstream message goes to the gate (as another addon left it),
        and no further; each is recorded on the flow within its bound."""
        ws = _socket_of(self.flow)
        message = ws.messages.pop()
        if not message.from_client:
            self._unread = 0
            if not message.dropped:  # as it came, unless an addon changed it
                content = self._raw[0] if self._raw is not None and message.content is self._raw[1] else message.content
                self.inbox.put_nowait((content, message.is_text))
                self.queued += len(content)
            message.drop()
            if self.queued > QUEUE_HIGH:
                self.set_reading(False)
            elif not self._paused and self.conn is not None:
                self.conn.set_reading(True)  # (paused while its hooks ran)
        self._raw = None
        self.record.message(message.content, message.is_text, message.from_client, masked=True)

    def _closed(self, code: int, reason: str) -> None:
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
            if self.flow.response is not None and self.flow.response.timestamp_end is None:
                self.flow.response.timestamp_end = time.time()


class ClientSide:
    """The gate's end of the hop inside the process, for control frames only (messages go in whole,
    `LayerSocket.send`): a wsproto client whose frames go into mitmproxy's layer in the order they were
    made (`write`): the close, and pongs to the layer's pings, one at a time for the latest ping
    (RFC 6455 5.5.3), so a flood costs one task, not one per ping."""

    def __init__(self, extensions: list, feed, clock=time.monotonic):
        self.ws = Connection(ConnectionType.CLIENT, extensions)
        self._clock, self._window, self._pings = clock, clock(), 0
        self._feed = feed  # async (frames) -> None
        self.writing = asyncio.Lock()  # its frames and the socket's messages go into the layer in order
        self._ping: Ping | None = None  # the latest ping not yet answered

    async def send(self, event) -> None:
        await self.write(self.ws.send(event))

    async def write(self, data: bytes) -> None:
        async with self.writing:
            await self._feed(data)

    def received(self, data: bytes) -> bool:
        """The layer's frames for the client side; False when pings come faster than PINGS_PER_SECOND
        (a server pings every few seconds; a flood would cost CPU in mitmproxy's layer for each)."""
        try:
            self.ws.receive_data(data)
            pings = [e for e in self.ws.events() if isinstance(e, Ping)]
        except Exception:  # noqa: BLE001 - nothing but control frames is expected here
            return True
        now = self._clock()
        if now - self._window >= 1.0:
            self._window, self._pings = now, 0
        self._pings += len(pings)
        if self._pings > PINGS_PER_SECOND:
            return False
        if pings:
            pending, self._ping = self._ping, pings[-1]
            if pending is None:
                asyncio.get_running_loop().create_task(self._pong())
        return True

    async def _pong(self) -> None:
        ping, self._ping = self._ping, None
        if ping is not None:
            await self.send(ping.response())


def upstream_max() -> int:
    """The largest upstream message taken: failover_max_body, at most UPSTREAM_MAX (mitmproxy's layer
    joins a frame's pieces with `+=`, so a larger one would cost time quadratic in its size)."""
    return min(WsConn.max_message, UPSTREAM_MAX)


def _deflate_as_accepted(accepted: str) -> list:
    """The client side's permessage-deflate, as the upstream's 101 accepted it (as mitmproxy does)."""
    ours = []
    for ext in split_comma_header(accepted.encode("ascii", "replace")):
        if ext.split(";", 1)[0].strip() == PerMessageDeflate.name:
            ours.append(PerMessageDeflate())
            ours[-1].finalize(ext)
    return ours


def _socket_of(flow: http.HTTPFlow) -> websocket.WebSocketData:
    """The flow's socket: there from the upgrade on (its websocket_* hooks run after it)."""
    assert flow.websocket is not None
    return flow.websocket


def _bound_inflate(extensions: list) -> None:
    """Each plain permessage-deflate in `extensions` replaced by a BoundedDeflate in the same state."""
    for i, ext in enumerate(extensions):
        if type(ext) is PerMessageDeflate:
            bounded = BoundedDeflate(upstream_max())
            bounded.__dict__.update({k: v for k, v in vars(ext).items() if k not in ("max_message", "_taken")})
            extensions[i] = bounded


async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
    tasks = {asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()

