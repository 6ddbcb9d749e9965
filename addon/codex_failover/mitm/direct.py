"""Attempt 1 on the client's own stream: the request goes upstream as mitmproxy sends any request,
and its answer is held in the client's own layers until the run decides (docs/architecture.md#the-
direct-attempt).

Why: CPU. An attempt over a kept connection is a second flow through mitmproxy's HTTP layers and a
second stream into the client's (the hop's), which cost a held request 1.5x-1.6x what plain mitmdump
spends on it (docs/measurements.md). Most Codex requests are served by their first attempt on the
client's own credential, straight to the URL the client asked for: that one needs neither.

A `DirectAttempt` is an `Attempt` (the run drives it the same way: items in its queue, a verdict,
cancel) whose bytes are the client stream's. mitmproxy's layers give the stream its connection and
write the request (with the real credential only while they write its head, held_layer.py); each
response event that reaches the stream from that connection is handed here first (`on_event`):
- holding (until the verdict): kept, and queued for the run as the attempt's items;
- released (a commit): what was kept goes to the stream, and from then on every event passes, each
  chunk shown to the machine (`live`) as the committed stream's rest;
- items (a commit while the hop answers already, recovery's heartbeat): the items go on, the events
  are dropped (the hop streams them);
- dropped (a failover, a timeout, the client gone): the stream is handed to its hop, which answers
  with whatever the run decides next; the upstream stream is reset (HTTP/1.1: its connection closed).
When it serves on the client's stream (the run commits it: released), the client's own flow is its
record: that flow's request is the one that left and its answer the one this attempt received, so it
gets the attempt's mark and nothing is shown twice (`judge`). Otherwise (failed over, retried, timed
out, cancelled, or answered through the hop), its flow
(`self.flow`, a record never run by the layers) gets the hooks an attempt gets, through mitmproxy's own
dispatch once the verdict is in and it ended (requestheaders, request, responseheaders, then error or
response: `_record`), so mitmweb shows it and `-w` saves it as it shows every other attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

from mitmproxy import ctx, flow as mitmflow, hooks, http

from ..core.after_output import Released
from ..core.codex_request import held_as_stream
from . import bounded_body
from .attempt import Attempt, Item, copy_request, hide_secrets, secrets_in
from .secret_guard import arming
from .warm_conn import server_at

log = logging.getLogger("codex_failover")
_records: set[asyncio.Task] = set()  # the records waiting for their verdict and end (`DirectAttempt._record`)


async def _shown(flow: http.HTTPFlow, verdict_error: str | None, keep_capture) -> None:
    """A record's hooks, in an attempt's order, through mitmproxy's own dispatch (as its layers run a
    flow's): requestheaders, request, responseheaders (a head came), then error or response."""
    addons = ctx.master.addons
    await addons.handle_lifecycle(hooks.all_hooks["requestheaders"](flow))
    await addons.handle_lifecycle(hooks.all_hooks["request"](flow))
    if flow.response is not None:
        await addons.handle_lifecycle(hooks.all_hooks["responseheaders"](flow))
        keep_capture()  # what the stream began with (bounded), for mitmweb
        if flow.response.timestamp_end is None:
            flow.response.timestamp_end = time.time()
    if verdict_error is not None or flow.error is not None:
        flow.error = mitmflow.Error(verdict_error or (flow.error.msg if flow.error else ""))
        await addons.handle_lifecycle(hooks.all_hooks["error"](flow))
    else:
        await addons.handle_lifecycle(hooks.all_hooks["response"](flow))


class Mode(enum.Enum):
    """What becomes of the response events its upstream gives the stream (`_take` in held_layer.py):

        HOLDING ──release──▶ RELEASED ──a rejection after output──▶ CUTTING ──its end passed──▶ CUT
           ├──commit through the stand-in──▶ ITEMS
           └──cancel, a failed connection──▶ DROPPED
    """

    HOLDING = enum.auto()  # kept for the stream; the run reads them as items
    RELEASED = enum.auto()  # committed: they pass to the stream, through the committed machine
    ITEMS = enum.auto()  # committed, answered by the stand-in (recovery's heartbeat): items only
    DROPPED = enum.auto()  # the stream went to its stand-in: nothing more is taken
    CUTTING = enum.auto()  # released, then a rejection after its output began: the stream's end is due
    CUT = enum.auto()  # ...and it ended there (its upstream reset): nothing more is taken


HOLDING, RELEASED, ITEMS, DROPPED, CUTTING, CUT = (Mode.HOLDING, Mode.RELEASED, Mode.ITEMS, Mode.DROPPED, Mode.CUTTING,
                                                   Mode.CUT)


class DirectAttempt(Attempt):
    """Attempt 1, carried by the client's own stream (see the module docstring)."""

    direct = True

    def __init__(self, client_flow: http.HTTPFlow, label: str, n: int, hop, original: http.Request):
        # Its record shows the client's own request and the client flow's server until the verdict: a served
        # attempt's record is the client's flow; a loser's gets copies of its own then (`_settle`).
        super().__init__(client_flow, client_flow.request, label, n, None,  # type: ignore[arg-type]
                         server=client_flow.server_conn)
        self.hop, self.original = hop, original  # the client's request as it came: the wire's secrets
        self.client_flow = client_flow
        self.served = False  # the run committed it: the client's flow is its record (`judge`)
        self.registry: dict | None = None  # the attempts by flow id it is registered in (the run's)
        self.sent_at: float | None = None  # when its head was written
        self.settled = False  # its record holds a request and a response of its own (`_settle`)
        self.mode = HOLDING
        self.server = None  # the upstream connection mitmproxy gave the stream
        self.kept: list = []  # the response events held for the stream
        self.kept_bytes = 0
        self.overflow = False  # what it held passed failover_max_body
        self.whole: list[bytes] = []  # a body that is not streamed, for the run's ReadWhole (the kept events' own bytes)
        self.live_feed: Callable[[bytes | None], Released] | None = None  # after a release: each chunk (None: the end) to the committed machine, what passes
        self.ended = asyncio.Event()  # its response ended, failed or was stopped
        self.begun = False  # started: its request is the stream's (`start`)
        self.record: asyncio.Task | None = None  # a loser's record's coroutine, once its verdict is in (`_record`)

    # -- the run's side ---------------------------------------------------------------------

    def start(self, via=None) -> None:
        self._hide_secrets()  # the real values stay off the record (and are masked in any log)
        self.hop.direct = self
        self.hop.decide(True)
        self.begun = True
        if self.on_sent is not None:  # the request hook need not wait: the head leaves once it returns
            self.on_sent()

    async def cancel(self, timeout: float = 5.0) -> None:
        """Hand the stream to its hop (the next answer comes from there); the upstream stream is reset
        unless the whole response is in. A released winner is mitmproxy's stream: nothing to do."""
        if not self.begun and self.registry is not None:  # never started: no record will take it out
            self.registry.pop(self.flow.id, None)
        self.judged.set()
        if self.mode not in (RELEASED, CUTTING, CUT):  # (a released one's verdict is the run's)
            self._show_record()
        if self.mode in (RELEASED, DROPPED, CUTTING, CUT):
            return
        self._drop("attempt cancelled by codex-failover" if not self.finished else None)
        await self.hop.cancel_direct()
        if self.record is not None and not self.over.is_set():  # its record's last hook (`_record`)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.over.wait(), timeout)

    def _drop(self, error: str | None) -> None:
        self.mode = DROPPED
        self.kept.clear()
        self.set_reading(True)
        if error is not None and not self.ended.is_set():
            self.flow.error = mitmflow.Error(error)
            self.ended.set()

    def judge(self, mark: str, comment: str, error: str | None) -> None:
        """The verdict. Served on the client's own stream (released: the stream got this attempt's head
        and bytes), it marks the client's flow, which is its record then. Answered through the hop
        (recovery's heartbeat; a whole answer the run sends on) or given once its record began to show,
        it keeps a record of its own, settled now: the stream's request and response stay as they are."""
        if error is None and self.mode in (RELEASED, CUTTING, CUT) and not self.settled:  # (its stream may have ended already)
            self.served = True
            self.client_flow.marked = mark
            self.over.set()  # no record of its own: no hook to wait for
        else:
            self._settle()
        super().judge(mark, comment, error)
        if not self.served:
            self._show_record()

    def unjudged(self) -> None:
        """Its run ended without a verdict on it (a bug; a cancel of a released one is none): unless it was
        served, its record is shown as it is (once: `_show_record`)."""
        self.judged.set()
        self._show_record()

    def release(self, live_feed, held: bytes) -> tuple[list, bytes]:
        """The commit: the held head (and end), and the bytes for the stream now: `held` (the whole
        events the machine saw) and the whole events of chunks already queued that it has not seen
        yet; the rest passes, each chunk through `live_feed` (the committed machine: whole events,
        or the cut at a rejection after the output began, core/after_output.py)."""
        unseen, ended = bytearray(), False
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item.kind == "chunk":
                unseen += item.data
            elif item.kind == "end":
                ended = True
        self.mode, self.live_feed = RELEASED, live_feed
        body = bytearray(held)
        if unseen:
            body += self._feed(bytes(unseen))
        if ended and self.mode is RELEASED:
            body += self._feed(None)
        self.set_reading(True)
        kept, self.kept = self.kept, []
        return kept, bytes(body)

    @property
    def done(self) -> bool:
        """Its record had its last hook (an attempt on a kept connection: its task ended)."""
        return self.over.is_set()

    def commit_through_hop(self) -> None:
        """A commit while the hop answers already (heartbeat): the items go on, the events are dropped."""
        self.mode = ITEMS
        self.kept.clear()

    # -- what the layers ask of it ------------------------------------------------------------

    @property
    def holding(self) -> bool:
        return self.mode is HOLDING

    @property
    def takes_events(self) -> bool:
        """Does its upstream's next event mean anything (not dropped, not cut)?"""
        return self.mode in (HOLDING, RELEASED, ITEMS)

    @property
    def passing(self) -> bool:
        """Released: its upstream's events pass to the stream."""
        return self.mode is RELEASED

    @property
    def cutting(self) -> bool:
        """Its stream is to end now, before a rejection after the output began."""
        return self.mode is CUTTING

    def cut_ended(self) -> None:
        self.mode = CUT

    def done_streaming(self) -> None:
        """Its released stream ended (the client flow's last hook): nothing more is taken, and the
        committed machine is let go (a finished request is freed by reference counting)."""
        if self.mode in (RELEASED, CUTTING):
            self.mode = CUT
        self.live_feed = None
        if self.registry is not None:  # (a loser's record takes it out once shown)
            self.registry.pop(self.flow.id, None)

    def set_reading(self, on: bool, shared_too: bool = False) -> None:
        """Pause or resume reading its upstream (an HTTP/2 one, which other streams of the client's
        may share, only when `shared_too`: a client that does not read its own stream)."""
        self._paused = not on
        if self.server is not None and (on or shared_too or self.server.alpn != b"h2"):
            self.hop.set_reading(self.server, on)

    # -- from the client's layers (synchronous) ------------------------------------------------

    def wire_head(self, headers: http.Headers) -> http.Headers:
        """The head as the wire gets it: the client's own secret values where the flow shows
        placeholders, and no Proxy-Authorization (it was for this proxy)."""
        wire = headers.copy()
        for name, values in self._wire.items():
            if name in wire:
                wire.set_all(name, self.original.headers.get_all(name) or values)
        wire.pop("proxy-authorization", None)
        return wire

    def _hide_secrets(self) -> None:
        """The wire's secret values are the client's own (its request as it came); they are masked in
        any log, and the request its record shows (the client flow's) holds placeholders."""
        headers = self.original.headers
        for name in secrets_in(headers):
            self._wire[name] = headers.get_all(name)
        arming(v for values in self._wire.values() for v in values)
        self.redact()

    def head_sent(self, request: http.Request, server) -> None:
        """Its head was written on `server` (`request`: the client flow's, which its record shows)."""
        self.sent_at = time.time()
        self.flow.server_conn = self.server = server
        self.sent = self.connected = True

    def _settle(self) -> None:
        """Once, for a record to be shown: copies of what left (no proxy credential: `wire_headers`) and of
        what came, and a server connection of its own if its head never left."""
        if self.settled:
            return
        self.settled = True
        record = copy_request(self.flow.request)
        record.headers.pop("proxy-authorization", None)
        if self.sent_at is not None:
            record.timestamp_start = record.timestamp_end = self.sent_at
        hide_secrets(record)
        self.flow.request = record
        if not self.sent:  # (until then it shows the client flow's server)
            self.flow.server_conn = server_at((record.host, record.port))
        if self.flow.response is not None and self.streaming:  # (a body read whole is its own already)
            self.flow.response = copy_request(self.flow.response)

    def _show_record(self) -> None:
        """A loser's verdict is in (the run's, or a cancel's: a run that ends without one cancels,
        `start_run`): its record of its own gets its hooks once it ended (`_record`). A served attempt has
        none: the client's flow is its record, and its stream's end takes it out of the registry
        (`done_streaming`)."""
        if self.record is None and self.begun and not self.served:  # (never started: nothing to show)
            self._settle()
            self.record = asyncio.get_running_loop().create_task(self._record())
            _records.add(self.record)  # (the loop holds a task only weakly)
            self.record.add_done_callback(_records.discard)

    async def _record(self) -> None:
        """A loser's record: its hooks once it ended, on no timer."""
        try:
            await self.ended.wait()
            await _shown(self.flow, self.verdict_error, self._keep_capture)
        finally:
            self.over.set()
            if self.registry is not None:
                self.registry.pop(self.flow.id, None)

    def connect_failed(self, err: str) -> None:
        self.mode = DROPPED
        if not self.ended.is_set():  # (stopped already: its record may have had its final hook)
            self.flow.error = mitmflow.Error(err)
            self.queue.put_nowait(Item("error", err.encode()))
            self.ended.set()

    def client_left(self, why: str) -> None:
        """The client reset or left the stream: whatever mode, the record ends (the run sees the hop's)."""
        self.ended.set()
        self.hop.client_left(why)

    def keep(self, event, size: int) -> bool:
        """A response event held for the stream (`size`: its body bytes), until the run decides;
        False once what it holds passed failover_max_body (nothing more is taken: the run sees an error)."""
        if self.overflow:
            return False
        self.kept.append(event)
        self.kept_bytes += size
        if self.kept_bytes > bounded_body.limit:
            log.warning("codex-failover: a held response passed failover_max_body; it is stopped")
            self.overflow = True
            self.kept.clear()
            self.whole.clear()
            self.queue.put_nowait(Item("error", b"the held response passed failover_max_body"))
            self.flow.error = mitmflow.Error("the held response passed failover_max_body")
            self.ended.set()
            return False
        return True

    def on_head(self, response: http.Response, end_stream: bool) -> None:
        self.streaming = held_as_stream(response.status_code, response.headers.get("content-type"), self.wants_stream)
        # A body read whole is kept on the record's own copy; a stream's head is the stream's until the
        # verdict (`_settle`: a served attempt's is never copied).
        self.flow.response = response if self.streaming and not self.settled else copy_request(response)
        self.queue.put_nowait(Item("head"))
        if end_stream:
            self.on_end()

    def on_data(self, data: bytes) -> bytes:
        """A chunk of its answer; released, what the stream gets of it now (whole events)."""
        if self.mode is RELEASED:  # (the client's flow is its record: its capture is the stream's own)
            return self._feed(data)
        if self.streaming:
            self._on_chunk(data)
        else:  # read whole, as mitmproxy reads a body it does not stream (the run's ReadWhole)
            self.captured(data)
            self.whole.append(data)
        return b""

    def on_end(self) -> bytes:
        """Its answer ended; released, the last bytes the stream gets (an event without its blank line)."""
        self.finished = True
        if self.flow.response is not None and not self.streaming:
            self.flow.response.raw_content = b"".join(self.whole)
        out = b""
        if self.mode is RELEASED:
            out = self._feed(None)
        else:
            self.queue.put_nowait(Item("end"))
        self.ended.set()
        return out

    def on_broken(self, message: str) -> None:
        if self.mode is not RELEASED:
            self.queue.put_nowait(Item("error", message.encode()))
        self.flow.error = mitmflow.Error(message)
        self.ended.set()

    def _feed(self, data: bytes | None) -> bytes:
        """A released chunk (None: the end) through the committed machine: what passes now. At a cut
        the attempt is over (CUT): the layers end the stream and reset its upstream."""
        assert self.live_feed is not None, "released: its feed is set"
        try:
            released = self.live_feed(data)
        except Exception:  # noqa: BLE001 - the bookkeeping of a stream never breaks the stream
            log.exception("codex-failover: a committed stream's bookkeeping failed")
            return data or b""
        if released.cut is not None:
            self.mode = CUTTING
            self.ended.set()
        return released.out
