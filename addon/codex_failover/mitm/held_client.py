"""The held client's side of one request: its held stream, and every answer it gets.

The client flow's stream is held when the hold starts (held_stream.py; the loopback relay when that
cannot be done, docs/architecture.md#the-held-stream); whatever the run decides (the committed
attempt's stream, a whole answer, recovery's heartbeat stream) reaches the client through it, once.
A committed stream goes through its attempt's machine on its way (`commit`): the client gets whole
events, the artifacts its credential made are learnt, and a rejection after the output began ends
the stream there instead (core/after_output.py), without `response.completed`, so Codex re-sends it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from mitmproxy import ctx, http
from mitmproxy.hooks import UpdateHook

from ..core.after_output import Released, cut_off
from ..core.attempt_events import Commit
from ..core.attempt_machine import AttemptMachine
from ..net.relay import Relay, RelaySession, UpstreamBroken
from . import bounded_body, client_answers, held_stream, quiet_log
from .attempt import CHUNK, END, PLACEHOLDER, SECRET_HEADERS, Attempt, Capture
from .direct import DirectAttempt
from .heartbeat import STREAM_HEADERS, HeartbeatSink
from .held_layer import ended, relay_server
from .held_stream import HOP_TAG, HeldStream

RELAY_TAG = "codex_failover.relay"
ERROR_BODY_CAP = 1024 * 1024  # an answer read in heartbeat mode for its error object only


def shown_changed(flow: http.HTTPFlow) -> None:
    """Tell mitmweb (its view addon) that a live flow's comment or mark changed between hooks;
    nothing to send when no addon listens (mitmdump)."""
    try:
        if quiet_log.listened("update"):
            ctx.master.addons.trigger(UpdateHook([flow]))
    except AttributeError:  # no master (unit tests without taddons)
        pass


def point_at_relay(flow: http.HTTPFlow, port: int, token: str) -> None:
    """Send the client's flow to the loopback relay; the real request is shown again later."""
    # Restored for display once the response ends; kept as plain data so the flow can be saved.
    state = flow.request.get_state()
    state["headers"] = tuple((k, PLACEHOLDER.encode() if k.decode("latin-1").lower() in SECRET_HEADERS else v)
                             for k, v in state["headers"])
    flow.metadata[RELAY_TAG] = state
    req = flow.request
    req.scheme, req.host, req.port = "http", "127.0.0.1", port
    req.path = f"/r/{token}"
    for name in ("authorization", "cookie", "chatgpt-account-id", "content-encoding", "transfer-encoding"):
        req.headers.pop(name, None)
    # The relay never reads the body (the attempts carry it): the hop forwards none.
    req.raw_content = b""
    req.headers["content-length"] = "0"
    flow.server_conn = relay_server(port)


class HeldClient:
    """One held client flow: its stream held from the start, answered once."""

    def __init__(self, flow: http.HTTPFlow, relay: Relay, abort, metrics=None):
        self.flow, self.relay, self.metrics = flow, relay, metrics
        self._abort: Callable[[], object] | None = abort  # the run's, for its hop (`hold`), kept by no one else
        self.started = time.monotonic()
        self.decided = asyncio.Event()  # the answer is given (the client has, or will have, its head)
        self.sink: HeartbeatSink | None = None  # heartbeat mode: the client already has its headers
        self.hop: HeldStream | RelaySession
        self._released: float | None = None  # when a direct attempt was committed

    def hold(self) -> None:
        """In the request hook: the stream held in its own layers (attempt 1 may ride it), or (when
        mitmproxy's layers are not as expected) the loopback relay. The run's `abort` goes to the hop
        only (here it would close a reference cycle with the run, freed by the collector alone)."""
        abort, self._abort = self._abort, None
        assert abort is not None, "held once"
        held = HeldStream.attach(self.flow, abort)
        if held is not None:
            self.hop = held
        else:
            self.hop = RelaySession.held(abort)
            point_at_relay(self.flow, self.relay.port, self.relay.register(self.hop))

    @property
    def answered(self) -> bool:
        return self.hop.is_answered

    async def first_output(self, timeout: float = 0.05) -> None:
        """Until the answer's first bytes went to the client (at most `timeout`): what the run does
        after a commit waits for the client's first output, never the other way round."""
        if isinstance(self.hop, HeldStream) and not self.hop.first_out.is_set():
            timer = asyncio.get_running_loop().call_later(timeout, self.hop.first_out.set)
            await self.hop.first_out.wait()
            timer.cancel()
        if self._released is not None and self.metrics is not None:  # a direct attempt's (`commit` times the others)
            self.metrics.first_output_to_client_seconds(time.monotonic() - self._released)
            self._released = None

    @property
    def can_go_direct(self) -> bool:
        """May the first attempt ride the client's own stream (mitm/direct.py)?"""
        return isinstance(self.hop, HeldStream) and self.hop.choosing and \
            bool(getattr(ctx.options, "failover_direct", True))

    def release(self, attempt, live_feed, held: bytes) -> None:
        """The committed direct attempt: the stream gets what was held (`held`: whole events), then
        the upstream's rest through `live_feed` (`commit`)."""
        if self.metrics is not None:
            self.metrics.hold_seconds(time.monotonic() - self.started)
        self._released = time.monotonic()  # its first output's time is taken in `first_output`
        self.decided.set()
        assert isinstance(self.hop, HeldStream)
        self.hop.release(attempt, live_feed, held)

    def commit(self, attempt: Attempt, state: AttemptMachine, command: Commit, cut: Callable[[], None]) -> None:
        """The committed attempt's way to the client: the whole events it held, then its live rest, each
        chunk through its machine (`cut`: told once, should the stream end before a rejection after its
        output began). Attempt 1 on the client's own stream is released there; any other attempt's
        stream (or attempt 1's, when the stand-in answers already: recovery's heartbeat) is handed over
        here, chunk by chunk."""
        feed = _watched(state, cut)
        if isinstance(attempt, DirectAttempt):
            if self.sink is None:
                return self.release(attempt, feed, command.held)
            attempt.commit_through_hop()  # (recovery's heartbeat): the items go on
        resp = attempt.flow.response
        assert resp is not None, "committed: its head is in"
        committed, metrics = time.monotonic(), self.metrics
        sized = cut_off(resp.headers)

        async def body():
            if metrics is not None:  # the head and the held bytes (the first output) went out
                metrics.first_output_to_client_seconds(time.monotonic() - committed)
            if command.error is not None:
                raise UpstreamBroken(command.error)
            if command.ended:
                return
            while True:
                item = await attempt.next_batch()
                if item.kind not in (CHUNK, END):
                    raise UpstreamBroken(item.data.decode(errors="replace"))
                released = feed(item.data if item.kind == CHUNK else None)
                if released.out:
                    yield released.out
                if released.cut is not None:
                    await attempt.cancel()
                    if sized:  # a body of a stated length is cut off (its client would wait for the rest)
                        raise UpstreamBroken("the stream ends before a rejection after its output began")
                    return
                if item.kind == END:
                    return

        self.stream(resp.status_code, resp.reason, list(resp.headers.fields), body, command.held)

    def stream(self, status: int, reason: str, headers: list, body, first: bytes = b"") -> None:
        """The winner: its head and `first` (the held bytes) now, its live rest (`body`) as it
        comes. In heartbeat mode the head went out already, and the body follows the keepalives."""
        if self.sink is not None:
            self.sink.deliver(_prepend(first, body))
        else:
            self._answer(status, reason, headers, body, first)

    def respond(self, answer: http.Response) -> None:
        """A whole response; in heartbeat mode its error, in-stream."""
        if self.sink is not None:
            try:
                # Only its error object is wanted: a bounded read (bounded_body.py), never get_content().
                error = json.loads(bounded_body.content_now(answer, ERROR_BODY_CAP).content or b"{}").get("error") or {}
            except ValueError:
                error = {}
            self.sink.fail(answer.status_code, error if isinstance(error, dict) else {"message": str(error)})
            return
        self._answer(answer.status_code, answer.reason, list(answer.headers.fields), _nothing,
                     answer.raw_content or b"")

    def start_heartbeat(self, interval: float) -> None:
        """Heartbeat mode: 200 event-stream headers now; keepalives flow until the outcome."""
        self.sink = HeartbeatSink(interval)
        self._answer(200, "OK", list(STREAM_HEADERS), self.sink.body)

    def internal_error(self, failure: str) -> None:
        """A bug (or the client leaving) ended the run before it answered: a clear status, never a
        hung client or relay hop."""
        if self.sink is not None:
            self.sink.fail(502, {"type": "server_error", "code": "codex_failover_internal_error",
                                 "message": f"codex-failover internal error: {failure}"})
        elif not self.answered:
            self.respond(client_answers.internal_error(failure))

    def _answer(self, status: int, reason: str, headers: list, body, first: bytes = b"") -> None:
        if not self.decided.is_set() and self.metrics is not None:
            self.metrics.hold_seconds(time.monotonic() - self.started)
        self.decided.set()
        if isinstance(self.hop, HeldStream):
            self.hop.answer(status, reason, headers, body, first)
        else:
            self.hop.answer(status, reason, headers, _prepend(first, body))


def _watched(state: AttemptMachine, cut: Callable[[], None]) -> Callable[[bytes | None], Released]:
    """Each chunk of a committed stream (None: its end) through its machine; `cut` told at a cut."""

    def feed(data: bytes | None) -> Released:
        released = state.live(data)
        if released.cut is not None:
            cut()
        return released

    return feed


async def _nothing():
    return
    yield


def _prepend(first: bytes, body):
    """`body` (an async generator function) with `first` before it."""
    if not first:
        return body

    async def joined():
        yield first
        async for chunk in body():
            yield chunk

    return joined


class RelayHops:
    """A nested addon of FailoverAddon: a held client flow's answer is streamed live, its start kept
    for mitmweb; through the relay, the real (redacted) request is shown again once it ends."""

    def __init__(self):
        self.captures: dict[str, Capture] = {}  # client flow id -> what its relayed stream began with

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        assert flow.response is not None, "responseheaders: the head is in"
        if HOP_TAG in flow.metadata and flow.response.status_code != 101:  # the hop's own capture, unless replaced
            stream = flow.response.stream
            self.captures[flow.id] = stream if isinstance(stream, Capture) else Capture()
            flow.response.stream = self.captures[flow.id]
        elif RELAY_TAG in flow.metadata and flow.response.status_code != 101:
            flow.response.stream = self.captures[flow.id] = Capture()
            # The relay closes its own one-shot hop; the client keeps its connection for the next request.
            flow.response.headers.pop("connection", None)

    def response(self, flow: http.HTTPFlow) -> None:
        if HOP_TAG in flow.metadata:
            held_stream.direct_ended(flow)
            held_stream.flow_ended_unclaimed(flow)  # another addon answered it: its run stops
        self._restore(flow)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        held_stream.ws_started(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        if HOP_TAG in flow.metadata:
            held_stream.direct_ended(flow)
            held_stream.flow_ended_unclaimed(flow)
        self._restore(flow)

    def _restore(self, flow: http.HTTPFlow) -> None:
        original = flow.metadata.pop(RELAY_TAG, None)
        if original is not None:  # show the real request in mitmweb, not the relay hop
            flow.request = http.Request.from_state(original)
        if flow.metadata.pop(HOP_TAG, None):
            ended(flow.server_conn)  # before `-w` saves the flow (its hook runs after ours)
        capture = self.captures.pop(flow.id, None)
        if capture is not None and flow.response is not None and flow.response.raw_content is None:
            capture.keep_on(flow.response)
