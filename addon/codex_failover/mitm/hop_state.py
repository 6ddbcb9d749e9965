"""What a held client's hop knows and does apart from mitmproxy's layers (mitm/client_hop.py's
`ClientHop` is this plus the layers): whether the stream has claimed its stand-in, the first
output's bookkeeping, and the client leaving. Nothing here touches mitmproxy's proxy core."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

from ..net.relay import UNCLAIMED_TTL
from . import quiet_log

log = logging.getLogger("codex_failover")
SERVER_LOG = logging.getLogger(quiet_log.CONNECTION_LOGGERS[0])  # where a connection handler's lines go


class HopState:
    def __init__(self, handler, stream_id: int, abort: Callable[[], object]):
        self.handler, self.stream_id, self.abort = handler, stream_id, abort
        self.requested = asyncio.Event()  # the stream gave its request to the stand-in
        self.queue: list = []  # the HTTP events for the stream, handed over at the next delivery
        self.status: int | None = None
        self.reason, self.headers = "", []
        self.body: Callable[[], AsyncIterator[bytes]] | None = None
        self.first, self.pump = b"", None  # the held bytes; the task that streams the answer
        self.gone = self.detached = False
        self.claimed = False  # the stream handed its request to the stand-in
        self.flow_id = ""
        self.first_out = asyncio.Event()  # the answer's first body bytes went to the client
        self.delivering = False  # the stand-in's layer is handing the stream what was queued
        self._first_handed = False  # the stream has handed the first body bytes over (written once it returns)
        self._deferred: list = []  # the stream's log lines (commands.Log) while the head waits for the body
        self.on_data: Callable[[bytes], object] | None = None  # after a 101: the client's bytes (b"": their end)

    @property
    def is_answered(self) -> bool:
        return self.status is not None

    async def drained(self) -> None:
        if self.pump is not None and not self.pump.done():
            await asyncio.shield(self.pump)

    async def _claimed(self) -> bool:
        """Has the stream handed its request to the stand-in (it normally has by the answer)?"""
        if self.requested.is_set():  # no timer to arm on the first output's way
            return True
        try:
            await asyncio.wait_for(self.requested.wait(), UNCLAIMED_TTL)
            return True
        except TimeoutError:
            log.warning("codex-failover: a held client flow never reached its answer (another addon "
                        "answered or killed it?); its run is stopped")
            self._stop()
            return False

    def _body_started(self) -> None:
        """The stream is handing the first body bytes over: `written` once the layers return
        (`_HeldHttpLayer.event_to_child`), at the latest on the loop's next turn."""
        self._first_handed = True
        asyncio.get_running_loop().call_soon(self.written)

    def written(self) -> None:
        """What the stream handed over is written: the client gets head and first output now."""
        if not self._first_handed:
            return
        self.first_out.set()
        deferred, self._deferred = self._deferred, []
        for command in deferred:  # (mitmproxy's ConnectionHandler.log, to its server logger)
            if quiet_log.would_log(SERVER_LOG, command.level, command.message):
                self.handler.log(command.message, command.level)

    # -- the client leaving ----------------------------------------------------------------

    def client_left(self, why: str) -> None:
        """From the layers (synchronous): stop the run, and the answer if one is streaming."""
        if not self.detached:
            log.debug("codex-failover: held client left: %s", why)
            self._stop()

    def _stop(self) -> None:
        if self.gone:
            return
        self.gone = True
        self.queue.clear()
        self.requested.set()  # an answer waiting for the request goes on, and finds the client gone
        if self.on_data is not None:  # a WebSocket: its reader takes what came (a close frame), then ends
            self.on_data(b"")
            return
        if self.pump is not None and self.pump is not asyncio.current_task():
            self.pump.cancel()
        result = self.abort()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            asyncio.ensure_future(result).add_done_callback(lambda t: t.cancelled() or t.exception())
