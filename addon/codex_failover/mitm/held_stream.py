"""One held client stream: the only owner of its state (docs/architecture.md#the-held-stream).

A held model request's client stream is answered in its own layers: it gets a stand-in server
connection, never dialled, whose layer hands it the run's answer (a response, a winner's stream, a
heartbeat, or a 101 and then a WebSocket's bytes both ways); or attempt 1 rides the stream itself
(mitm/direct.py), and what its upstream answers is held for the run, then released to the client.
Which of these the stream is in is its `state`, one of core/held_states.py's, moved only through that
table (`_move`). Everything that touches mitmproxy's layers is the seam's (mitm/held_layer.py: the
`StreamWire` this stream drives, and the layers that call the methods below); when the layers are not
as expected, `HeldStream.attach` returns None and the loopback relay is used (net/relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

from mitmproxy import http

from ..core.after_output import Released
from ..core.held_states import HeldEvent, HeldState, after
from ..net.relay import UNCLAIMED_TTL, UpstreamBroken
from . import fallbacks
from .attempt import Capture
from .client_answers import client_response
from .direct import CUT, CUTTING, RELEASED
from .held_layer import StreamWire

log = logging.getLogger("codex_failover")

HOP_TAG = "codex_failover.hop"  # flow.metadata of a client flow answered in process
HOP_HOLDS = fallbacks.seam_holds("hop")
S, E = HeldState, HeldEvent
_streaming: set[HeldStream] = set()  # answers being streamed right now (the status page counts them)
_by_flow: dict[str, HeldStream] = {}  # client flow id -> its held stream, until its answer ended


def streaming() -> int:
    return len(_streaming)


class HeldStream:
    """One held client flow's stream (see the module's docstring); answered once, like a RelaySession."""

    def __init__(self, wire: StreamWire, flow_id: str, abort: Callable[[], object]):
        self.wire, self.flow_id, self.abort = wire, flow_id, abort
        self.state = S.CHOOSING
        self.gone = False  # ENDED because the client left (the run stops)
        self.requested = asyncio.Event()  # the stream gave its request away (to the stand-in, or upstream)
        self.taken = False  # ...and it did so (not only woken by the client leaving)
        self.first_out = asyncio.Event()  # the answer's first body bytes went to the client
        self.status: int | None = None  # the answer's status, once answered
        self.reason = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: Callable[[], AsyncIterator[bytes]] | None = None
        self.first = b""  # the held bytes that go with the head
        self.pump: asyncio.Task | None = None  # the task that hands the answer over
        self.on_data: Callable[[bytes], object] | None = None  # after a 101: the client's control frames (b"": their end)
        self.on_message: Callable[[bytes, bool], object] | None = None  # ...and its messages, whole
        self.direct = None  # attempt 1 on the stream (direct.py's DirectAttempt), once chosen
        self.riding = False  # the stream's connection is attempt 1's (from the choice; not when it failed or
        # was stopped before it had one): its request goes upstream there, and what comes back is the attempt's
        self.held_bytes = b""  # a committed direct attempt's held output (whole events), for its stream
        self.live_feed: Callable[[bytes | None], Released] | None = None  # ...and its rest's way (HeldClient.commit)
        wire.held = self

    # -- setup ------------------------------------------------------------------------------

    @classmethod
    def attach(cls, flow: http.HTTPFlow, abort: Callable[[], object]) -> HeldStream | None:
        """Give `flow` (in its request hook) its stand-in in the client's layers; None when that cannot
        be done here (the loopback relay is used instead)."""
        if not HOP_HOLDS:
            return None
        wire = StreamWire.attach(flow)
        if wire is None:
            return None
        held = cls(wire, flow.id, abort)
        flow.metadata[HOP_TAG] = True
        _by_flow[flow.id] = held
        return held

    def _move(self, event: HeldEvent) -> None:
        self.state = after(self.state, event)

    @property
    def ended(self) -> bool:
        return self.state is S.ENDED

    @property
    def is_answered(self) -> bool:
        return self.status is not None

    @property
    def choosing(self) -> bool:
        return self.state is S.CHOOSING

    # -- the direct attempt (direct.py) -----------------------------------------------------

    def decide(self, direct: bool) -> None:
        """The run's first attempt chose (once): ride the stream, or wait for the stand-in's answer."""
        if self.state is not S.CHOOSING:
            return
        self._move(E.DIRECT if direct else E.STAND_IN)
        self.riding = direct
        if self.wire.waiting is not None:  # the stream's parked connection request, answered as chosen
            self._turn("decide")

    def gets_upstream(self) -> bool:
        """Is the stream's connection request for mitmproxy's own connection (attempt 1 rides it)?"""
        return self.state is S.DIRECT_HELD and self.direct is not None and self.direct.holding

    def release(self, attempt, live_feed, held: bytes) -> None:
        """Commit the direct attempt: the stream gets the whole events held (`held`), then its
        upstream's rest through `live_feed` (held_client.HeldClient.commit)."""
        self._move(E.RELEASE)
        if self.state is S.ENDED:  # the client left meanwhile
            return
        self.status = 200 if attempt.flow.response is None else attempt.flow.response.status_code
        self.live_feed, self.held_bytes = live_feed, held
        self.pump = asyncio.get_running_loop().create_task(self._tell("release"))

    def released(self) -> tuple[list, bytes]:
        """For the layers at the release: the held head (and end), and the bytes the stream gets now."""
        if self.direct is None or self.live_feed is None:  # (ended meanwhile: nothing more goes out)
            return [], b""
        return self.direct.release(self.live_feed, self.held_bytes)

    def direct_failed(self) -> None:
        """Attempt 1 could not have the stream's connection (it failed, or the attempt was stopped
        meanwhile): the stream takes its stand-in, which answers what the run decides next."""
        self.riding = False
        self._move(E.CANCEL)

    async def cancel_direct(self) -> None:
        """Attempt 1 stopped: from now on the stream's answer is its stand-in's."""
        self._move(E.CANCEL)
        await self._tell("cancel")

    def handed(self) -> None:
        """A released direct stream was handed data: an HTTP/2 client whose window stays shut makes
        mitmproxy buffer it; past its bound the upstream is not read until that drained."""
        direct = self.direct
        if direct is not None and self.wire.h2_over():
            watching = direct.paused  # (again at each read: asyncio's reader resumes a transport it paused)
            direct.set_reading(False, shared_too=True)
            if not watching:
                _later(self._resume_direct(direct))

    async def _resume_direct(self, direct) -> None:
        """Attempt 1's upstream is read again once the stream's buffer drained, or the stream ended (then
        too: its connection may serve the client's other streams; the stream's end lets `direct` go)."""
        await self.wire.h2_drained(lambda: self.ended)
        direct.set_reading(True)

    def set_reading(self, server, on: bool) -> None:
        self.wire.set_reading(server, on)

    def _turn(self, what: str) -> None:
        _later(self._tell(what))

    async def _tell(self, what: str) -> None:
        if not self.gone:
            with contextlib.suppress(ConnectionError):
                await self.wire.turn(what)

    # -- the answer (RelaySession's interface) ------------------------------------------------

    def answer(self, status: int, reason: str, headers: list[tuple[bytes, bytes]],
               body: Callable[[], AsyncIterator[bytes]], first: bytes = b"") -> None:
        """The head and `first` go to the client together; then `body`, chunk by chunk."""
        self.decide(False)  # answered before any attempt rode the stream (no pool credential, say)
        self.status, self.reason, self.headers, self.body, self.first = status, reason, headers, body, first
        if self.state is S.ENDED:  # the client left meanwhile: nothing goes out, and the stream is forgotten
            self.detach()
            return
        self._move(E.ANSWER)
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            if await self._claimed():
                _streaming.add(self)
                await self._stream()
        except UpstreamBroken as exc:  # the client sees the stream cut, as it would have directly
            with contextlib.suppress(ConnectionError):  # the client left meanwhile
                await self._deliver(self.wire.error_event(f"upstream broke: {exc}"))
        except ConnectionError:
            self._stop()
        finally:
            self.detach()

    async def _stream(self) -> None:
        assert self.status is not None and self.body is not None, "answered"
        response = client_response(self.status, self.reason, self.headers)
        response.stream = Capture(on_first=self.wire.body_started)  # RelayHops keeps it for mitmweb
        if self.first:
            self.wire.join_first()  # head and first output in one write
        await self._deliver(*self.wire.head_events(response, self.first))
        async for chunk in self.body():
            if chunk:
                await self._deliver(self.wire.data_event(chunk))
        await self._deliver(self.wire.end_event())

    # -- a 101 (the WebSocket gate), then bytes both ways through the client's WebSocket layer --

    def upgrade(self, headers: list[tuple[bytes, bytes]], on_data: Callable[[bytes], object],
                on_message: Callable[[bytes, bool], object]) -> None:
        """Answer 101. Then the client's messages go whole to `on_message` (after every addon saw them),
        and the gate's go to the client whole (`send_message`); the control frames mitmproxy's WebSocket
        layer sends on toward the server go to `on_data` (b"": the client is gone), and `write` hands it
        the server side's (a pong, the close), in order."""
        self.decide(False)  # (a held upgrade is never a direct attempt's)
        self._move(E.UPGRADE)
        self.status, self.on_data, self.on_message = 101, on_data, on_message
        response = http.Response(b"HTTP/1.1", 101, b"Switching Protocols", http.Headers(headers), b"", None,
                                 time.time(), None)
        self._hand(*self.wire.head_events(response, b""), self.wire.end_event())

    def write(self, data: bytes) -> None:  # b"": the server side closed
        self._hand(self.wire.data_event(data) if data else self.wire.end_event())

    def client_data(self, data: bytes) -> None:
        """From the layers, after a 101: the client's control frames, as mitmproxy's WebSocket layer sends them on."""
        if self.on_data is not None:
            self.on_data(data)

    def client_message(self, content: bytes, is_text: bool) -> bool:
        """From the layers, after a 101: a message of the client's, whole. False: not taken (no gate reads it)."""
        if self.on_message is None or self.gone:
            return False
        self.on_message(content, is_text)
        return True

    async def send_message(self, content: bytes, is_text: bool) -> None:
        """After a 101: a whole message for the client (framed once, by its WebSocket layer)."""
        if not self.gone and self.state is not S.ENDED:
            await self.wire.send_message(content, is_text)

    def _hand(self, *events: object) -> None:
        if self.state is not S.ENDED:
            self.wire.queue += events
            if self.pump is None or self.pump.done():
                self.pump = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            if await self._claimed():
                while self.wire.queue and self.state is not S.ENDED:
                    await self._deliver()
        except ConnectionError:
            self._stop()

    async def drained(self) -> None:
        if self.pump is not None and not self.pump.done():
            await asyncio.shield(self.pump)

    async def _deliver(self, *events: object) -> None:
        if self.gone:
            raise ConnectionError("the client left")
        self.wire.queue.extend(events)
        await self.wire.deliver(lambda: self.gone)

    async def _claimed(self) -> bool:
        """Has the stream given its request away (it normally has by the answer)?"""
        if self.requested.is_set():
            return True
        try:
            await asyncio.wait_for(self.requested.wait(), UNCLAIMED_TTL)
            return True
        except TimeoutError:
            log.warning("codex-failover: a held client flow never reached its answer (another addon "
                        "answered or killed it?); its run is stopped")
            self._stop()
            return False

    # -- from the layers --------------------------------------------------------------------

    def request_taken(self) -> None:
        """The stream gave its request away: to its stand-in, or (attempt 1) upstream."""
        self.taken = True
        self.requested.set()

    def first_written(self) -> None:
        """The client has the answer's head and first output."""
        self.first_out.set()

    def client_left(self, why: str) -> None:
        """The client reset or left the stream (synchronous): stop the run, and the answer if one streams."""
        if self.state is not S.ENDED:
            log.debug("codex-failover: held client left: %s", why)
            self._stop()

    def _stop(self) -> None:
        if self.gone:
            return
        self.gone = True
        self._move(E.CLIENT_LEFT)
        self.wire.queue.clear()
        self.requested.set()  # an answer waiting for the request goes on, and finds the client gone
        if self.on_data is not None:  # a WebSocket: its reader takes what came (a close frame), then ends
            self.on_data(b"")
            return
        if self.pump is not None and self.pump is not asyncio.current_task():
            self.pump.cancel()
        result = self.abort()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            asyncio.ensure_future(result).add_done_callback(lambda t: t.cancelled() or t.exception())

    def detach(self) -> None:
        """The answer ended: the stand-in is closed, and forgotten once its stream is gone."""
        self.wire.written(final=True)  # first_out set, held log lines logged: whatever the answer was
        _streaming.discard(self)
        _by_flow.pop(self.flow_id, None)
        self.wire.end(claimed=self.taken)
        self._move(E.END)
        # The run's ways in (its abort, the committed feed's cut) and attempt 1 (whose hop this is): a finished
        # request is freed by reference counting, not by the collector (the wire let go of this too).
        self.abort, self.live_feed, self.direct, self.body = _nothing, None, None, None

    def stream_reset(self) -> bool:
        return self.wire.stream_reset()


def _nothing() -> None:
    return None


def _later(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


# -- the client flow's hooks (held_client.RelayHops) ----------------------------------------------

def direct_ended(flow: http.HTTPFlow) -> None:
    """The client flow's `response` or `error` hook: a released direct attempt's stream is done."""
    held = _by_flow.get(flow.id)
    direct = held.direct if held is not None else None
    # Released: its attempt's mode says so, whatever the stream's state (ENDED if the client left first).
    if held is not None and direct is not None and direct.mode in (RELEASED, CUTTING, CUT):
        if not direct.ended.is_set():  # the stream ended without its upstream's end (the client left)
            direct.client_left(flow.error.msg if flow.error else "the stream ended")
        held.detach()
        direct.done_streaming()


def flow_ended_unclaimed(flow: http.HTTPFlow) -> None:
    """The client flow's `error` or `response` hook: a client that left before its stream gave its request
    away (an HTTP/2 reset while the request hook still ran), or a flow another addon killed or answered,
    is seen here, not there."""
    held = _by_flow.get(flow.id)
    if held is not None and not held.taken:
        held.client_left(flow.error.msg if flow.error else "client error")


def ws_started(flow: http.HTTPFlow) -> None:
    """The client flow's `websocket_start` after a 101: its WebSocket layer takes the gate's messages
    whole, and its inside side (toward the stand-in: control frames only) speaks uncompressed, as the
    gate's end does (ws/client_pipe.py)."""
    held = _by_flow.get(flow.id)
    if held is None or held.on_data is None:
        return
    if not held.wire.ws_started():  # the layers are not as pinned: the session ends at once
        log.warning("codex-failover: a gated WebSocket's layers are not as expected; closing it")
        held.client_left("layers not as expected")
