"""The held stream in the client's own layers, in process (tests/support/layer_play.py): mitmproxy's
HttpLayer as a client connection's root layer, fed the client's and the upstream's bytes, with a
HeldStream (mitm/held_stream.py) attached in the request hook as the addon attaches it; each test
follows one path of core/held_states.py's table and asserts what the client and the upstream get on the
wire (each write), the stream's state at each step, and which connections were dialled or closed."""

from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.test import taddons

from codex_failover.core.after_output import AfterOutput, LiveSse, Released
from codex_failover.core.held_states import HeldEvent as E, HeldState as S, after
from codex_failover.core.provenance import SseArtifacts
from codex_failover.mitm import held_stream
from codex_failover.mitm.attempt import PLACEHOLDER, copy_request, hide_secrets
from codex_failover.mitm.direct import DirectAttempt
from codex_failover.mitm.held_client import RelayHops
from codex_failover.mitm.held_layer import HopLayer
from codex_failover.mitm.held_stream import HeldStream
from tests.support.layer_play import LayerPlay, play, settle, turns_until

SECRET = "Bearer sk-the-clients-own"
BODY = json.dumps({"model": "gpt-5-codex", "stream": True, "input": []}).encode()
REQUEST = (b"POST http://api.test/v1/responses HTTP/1.1\r\nHost: api.test\r\n"
           b"Authorization: " + SECRET.encode() + b"\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
SSE = [(b"content-type", b"text/event-stream")]
EV1, EV2, EV3 = b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


class Stream:
    """One held client stream in a LayerPlay: the request hook attaches its HeldStream as the addon does
    (RelayHops' hooks as the addon nests them), and `stopped` counts the run's aborts."""

    def __init__(self, p: LayerPlay):
        self.p, self.held = p, None
        self.stopped = 0
        self.flow: http.HTTPFlow | None = None
        hops = RelayHops()
        p.on["request"] = self._request
        p.on["responseheaders"] = hops.responseheaders
        p.on["response"] = hops.response
        p.on["error"] = hops.error
        p.on["websocket_start"] = hops.websocket_start

    def _request(self, flow: http.HTTPFlow) -> None:
        self.flow = flow
        self.original = copy_request(flow.request)  # the request as it came (the wire's secrets)
        hide_secrets(flow.request)  # as the run does before its first attempt
        self.held = HeldStream.attach(flow, self._abort)
        assert self.held is not None, "the layers are as held_layer.py understands them"

    def _abort(self) -> None:
        self.stopped += 1

    def direct(self) -> DirectAttempt:
        """Attempt 1 on the stream, started as the run starts it."""
        attempt = DirectAttempt(self.flow, "r1#1", 1, self.held, self.original)
        attempt.start()
        return attempt


@pytest.fixture(autouse=True)
def forgotten():
    """Every held stream a test played is forgotten by its end, whatever became of it."""
    held_stream._by_flow.clear()
    yield
    assert held_stream._by_flow == {}, "a held stream outlived its answer"
    assert held_stream.streaming() == 0, "an answer counted as streaming after it ended"


@pytest.fixture(autouse=True)
def moves(monkeypatch) -> list[tuple[S, E]]:
    """Every move of a held stream's state in the test, as (state, event), in order."""
    seen: list[tuple[S, E]] = []

    def recorded(state: S, event: E) -> S:
        seen.append((state, event))
        return after(state, event)

    monkeypatch.setattr(held_stream, "after", recorded)
    yield seen


def opened(p: LayerPlay) -> list[commands.OpenConnection]:
    return [c for c in p.commands if isinstance(c, commands.OpenConnection)]


async def body_of(*chunks: bytes):
    for data in chunks:
        yield data


# -- 1. CHOOSING -> STAND_IN -> ANSWERING -> ENDED ---------------------------------------------------

def test_the_stand_in_answers_a_stream_whose_connection_request_waited_for_the_choice(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            p.from_client(REQUEST)
            held = s.held
            assert held.state is S.CHOOSING
            assert held.wire.waiting is not None, "the stream's connection request is parked"
            assert not held.taken and opened(p) == [] and p.to_client() == []

            held.decide(False)
            await turns_until(lambda: held.taken)
            assert held.state is S.STAND_IN
            assert held.wire.waiting is None and p.to_client() == []

            held.answer(200, "OK", SSE, lambda: body_of(EV2, EV3), first=EV1)
            assert held.state is S.ANSWERING
            await turns_until(lambda: held.ended)
            writes = p.to_client()
            assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n" + chunk(EV1)), \
                "the head and the first output in one write"
            assert writes[1:] == [chunk(EV2), chunk(EV3), LAST_CHUNK]
            assert held.state is S.ENDED
            assert opened(p) == [], "the stand-in is never dialled, nor anything else"
            assert s.stopped == 0 and "response" in p.hooks
    play(go)
    assert moves == [(S.CHOOSING, E.STAND_IN), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


# -- attempt 1 on the stream ---------------------------------------------------------------------------

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
REJECTION = json.dumps({"error": {"type": "usage_limit_reached", "message": "limit"}}).encode()
REJECTED = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(REJECTION)).encode() + b"\r\n\r\n" + REJECTION)


async def riding(p: LayerPlay, s: Stream):
    """The request in, attempt 1 started on the stream, its connection dialled and its head written."""
    p.from_client(REQUEST)
    assert s.held.state is S.CHOOSING and opened(p) == []
    attempt = s.direct()
    assert s.held.state is S.DIRECT_HELD
    await turns_until(lambda: bool(p.opening))  # the parked connection request, answered as chosen
    server = p.open_next()
    assert server.address == ("api.test", 80)
    return attempt, server


def items_of(attempt: DirectAttempt) -> list[tuple[str, bytes]]:
    out = []
    while not attempt.queue.empty():
        item = attempt.queue.get_nowait()
        out.append((item.kind, item.data))
    return out


def released(data: bytes | None) -> Released:
    return Released(data or b"")


# -- 2. CHOOSING -> DIRECT_HELD -> DIRECT_RELEASED -> ENDED -------------------------------------------

def test_attempt_1_rides_the_stream_its_answer_held_until_the_release(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            head, *rest = p.to(server)
            assert head.startswith(b"POST /v1/responses HTTP/1.1\r\n")
            assert b"Authorization: " + SECRET.encode() + b"\r\n" in head, "the wire gets the real credential"
            assert b"".join(rest) == BODY
            assert s.flow.request.headers["authorization"] == PLACEHOLDER, "the flow shows placeholders"
            assert SECRET not in repr(s.flow.get_state())
            assert held.taken and held.state is S.DIRECT_HELD

            p.from_server(server, SSE_HEAD + chunk(EV1))
            p.from_server(server, chunk(EV2))
            assert p.to_client() == [], "held: nothing for the client"
            assert items_of(attempt) == [("head", b""), ("chunk", EV1), ("chunk", EV2)]  # the run read them

            held.release(attempt, released, EV1 + EV2)  # the run commits: the machine saw EV1 and EV2
            assert held.state is S.DIRECT_RELEASED
            await turns_until(lambda: bool(p.to_client()))
            first, = p.to_client()
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\n" + chunk(EV1 + EV2)), \
                "the head and what was held in one write"

            p.from_server(server, chunk(EV3[:4]) + chunk(EV3[4:]) + LAST_CHUNK)  # one read: its data, then the end
            assert p.to_client()[1:] == [chunk(EV3), LAST_CHUNK], "a read's chunks joined, before the end"
            assert held.state is S.ENDED, "the client flow's response hook ended it"
            assert len(opened(p)) == 1 and s.stopped == 0
            assert server not in p.closed, "a served stream's connection is kept, as mitmproxy keeps it"
            assert held.wire.conn is None and not any(isinstance(c, HopLayer) for c in p.layer.connections.values()), \
                "a stream served on its own connection never had a stand-in"
            assert s.flow.server_conn is server, "its flow shows the connection that served it"
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.RELEASE), (S.DIRECT_RELEASED, E.END)]


# -- 3. DIRECT_HELD -> STAND_IN (a failover) -----------------------------------------------------------

def test_a_failover_closes_the_upstream_and_the_client_gets_the_stand_ins_answer(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, REJECTED[:60])  # the rejection's head, its body still to come
            assert p.to_client() == [] and held.state is S.DIRECT_HELD

            await attempt.cancel(timeout=0.5)  # the run fails over
            assert held.state is S.STAND_IN
            assert server in p.closed, "the upstream's stream reset (HTTP/1.1: its connection closed)"
            writes_to_server = len(p.to(server))
            p.from_server(server, REJECTED[60:])  # (a closed connection's last bytes reach nobody)

            held.answer(200, "OK", SSE, lambda: body_of(EV2), first=EV1)
            assert held.state is S.ANSWERING
            await turns_until(lambda: held.ended)
            writes = p.to_client()
            assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(chunk(EV1))
            assert writes[1:] == [chunk(EV2), LAST_CHUNK]
            assert not any(b"429" in w or b"usage_limit" in w for w in writes), "nothing of the rejection"
            assert len(p.to(server)) == writes_to_server and len(opened(p)) == 1
            assert held.state is S.ENDED and s.stopped == 0
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.CANCEL), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


# -- 4. DIRECT_RELEASED, then a rejection after the output began (the cut) ---------------------------

def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_a_rejection_after_the_output_began_ends_the_stream_cleanly_and_closes_the_upstream(moves, rules):
    delta, more = sse({"type": "response.output_text.delta", "delta": "Hi"}), \
        sse({"type": "response.output_text.delta", "delta": " there"})
    overload = sse({"type": "error", "error": {"type": "server_error", "code": "server_is_overloaded",
                                               "message": "overloaded"}})
    made = SseArtifacts()
    made.frame(delta)  # what the hold framed before the commit
    machine = LiveSse(made, AfterOutput(rules))  # the committed machine: whole events, the cut at the overload

    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, SSE_HEAD + chunk(delta))
            items_of(attempt)
            held.release(attempt, machine.feed, machine.held(delta))
            await turns_until(lambda: bool(p.to_client()))
            assert held.state is S.DIRECT_RELEASED

            p.from_server(server, chunk(more[:9]))  # an event's first bytes: kept back until it is whole
            assert len(p.to_client()) == 1
            p.from_server(server, chunk(more[9:] + overload))
            writes = p.to_client()
            assert writes[0].endswith(b"\r\n\r\n" + chunk(delta))
            assert writes[1:] == [chunk(more), LAST_CHUNK], "the whole events before it, then a clean end"
            assert b"server_is_overloaded" not in b"".join(writes)
            assert server in p.closed, "the upstream connection is closed"
            assert held.state is S.ENDED
            p.from_server(server, chunk(EV3))  # (whatever still came: nobody's)
            assert p.to_client() == writes and p.client not in p.closed
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.RELEASE), (S.DIRECT_RELEASED, E.END)]


def test_an_upstream_that_breaks_after_the_release_breaks_the_clients_stream(moves):
    made = SseArtifacts()
    made.frame(EV1)
    machine = LiveSse(made, None)

    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, SSE_HEAD + chunk(EV1))
            items_of(attempt)
            held.release(attempt, machine.feed, machine.held(EV1))
            await turns_until(lambda: bool(p.to_client()))
            p.from_server(server, chunk(EV2)[:7])  # half an event, then the connection drops
            p.server_closed(server)
            assert p.to_client()[1:] == [], "half an event never reaches the client"
            assert p.client in p.closed, "its stream breaks as the upstream's did (HTTP/1.1: no last chunk)"
            assert held.state is S.ENDED and s.stopped == 0 and p.hooks[-1] == "error"
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.RELEASE), (S.DIRECT_RELEASED, E.END)]


# -- 5. CLIENT_LEFT --------------------------------------------------------------------------------------

def test_a_client_that_leaves_while_the_run_chooses_stops_the_run_and_nothing_goes_upstream(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            p.from_client(REQUEST)
            held = s.held
            assert held.state is S.CHOOSING
            p.client_closed()
            assert s.stopped == 1, "the run is stopped"
            assert held.state is S.ENDED and held.gone
            s.direct()  # the run's attempt 1 starts all the same (it raced the client)
            await settle()
            assert held.state is S.ENDED
            assert opened(p) == [] and p.to_client() == [], "nothing dialled, nothing written"
            assert s.stopped == 1
            run_ended_unanswered(held)
            assert p.to_client() == []
    play(go)
    assert moves == [(S.CHOOSING, E.CLIENT_LEFT), (S.ENDED, E.END)]


def run_ended_unanswered(held: HeldStream) -> None:
    """The stopped run's end: it answers (request_run.start_run: an internal error, as for any run that
    ended without an answer), and the stream, whose client is gone, is forgotten and its stand-in, if it
    had one, closed (else every request a client gave up while held keeps its connection's layers alive)."""
    held.answer(502, "Bad Gateway", [], lambda: body_of(b"the request ended without an answer"))
    assert held.flow_id not in held_stream._by_flow, "the held stream is forgotten"
    stand_in = held.wire.conn
    assert stand_in is None or (stand_in.state is ConnectionState.CLOSED and stand_in.via is None), \
        "its stand-in is closed"


def test_a_client_that_leaves_while_attempt_1_is_held_stops_the_run_and_the_upstream(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, SSE_HEAD + chunk(EV1))
            sent = len(p.to(server))
            p.client_closed()
            assert s.stopped == 1 and held.state is S.ENDED
            assert attempt.ended.is_set()
            assert server in p.closed, "the upstream connection is closed"
            p.from_server(server, chunk(EV2))
            await settle()
            assert len(p.to(server)) == sent and p.to_client() == [], "nothing after"
            held.release(attempt, released, EV1)  # a commit that raced the client: it finds the stream ended
            await settle()
            assert held.state is S.ENDED and p.to_client() == []
            assert len(opened(p)) == 1 and s.stopped == 1
            run_ended_unanswered(held)
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.CLIENT_LEFT), (S.ENDED, E.RELEASE), (S.ENDED, E.END)]


# -- 6. STAND_IN -> UPGRADED (the gate's WebSocket) ----------------------------------------------------

UPGRADE = (b"GET http://api.test/v1/responses HTTP/1.1\r\nHost: api.test\r\nUpgrade: websocket\r\n"
           b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Authorization: " + SECRET.encode() + b"\r\n\r\n")
SWITCHED = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
            (b"sec-websocket-accept", b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")]  # (RFC 6455's example key's answer)


def masked(payload: bytes, mask: bytes = b"\x01\x02\x03\x04") -> bytes:
    """A client's text frame (masked, as RFC 6455 has a client send it)."""
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def unmasked(frame: bytes) -> tuple[int, bytes]:
    """A short masked frame's opcode and payload."""
    size, mask = frame[1] & 0x7F, frame[2:6]
    assert frame[1] & 0x80 and len(frame) == 6 + size
    return frame[0] & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(frame[6:]))


def test_the_stand_in_answers_101_then_messages_go_whole_both_ways_and_only_control_frames_cross_it(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            p.on["websocket_start"] = held_stream.ws_started  # (the addon's hook: held_client.py)
            s = Stream(p)
            p.from_client(UPGRADE)
            held = s.held
            assert held.state is S.CHOOSING and opened(p) == []
            held.decide(False)
            await turns_until(lambda: held.taken)
            assert held.state is S.STAND_IN

            control: list[bytes] = []
            messages: list[tuple[bytes, bool]] = []
            held.upgrade(SWITCHED, control.append, lambda content, is_text: messages.append((content, is_text)))
            assert held.state is S.UPGRADED
            await turns_until(lambda: "websocket_start" in p.hooks)
            assert p.to_client() == [b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                                     b"sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"]

            p.from_client(masked(b"hi"))
            await settle()
            assert messages == [(b"hi", True)] and control == [], "the client's message, whole, after its hook; no frame"
            assert p.hooks.count("websocket_message") == 1
            await held.send_message(b"hey", True)  # the gate's message: framed once, by the layer
            assert p.to_client()[1:] == [b"\x81\x03hey"] and p.hooks.count("websocket_message") == 2
            held.write(b"\x89\x00")  # the gate's end's control frame (a ping: a server's, unmasked)
            await settle()
            assert p.to_client()[2:] == [b"\x89\x00"]

            p.client_closed()
            assert control[-1] == b"", "the gate's end learns the client is gone"
            assert unmasked(control[-2])[0] == 0x8, "after a close frame"
            assert held.state is S.ENDED and "websocket_end" in p.hooks
            assert opened(p) == [], "the stand-in is never dialled"
            held.detach()  # (the gate's end, once its session ended: ws/client_pipe.py)
    play(go)
    assert moves == [(S.CHOOSING, E.STAND_IN), (S.STAND_IN, E.UPGRADE), (S.UPGRADED, E.CLIENT_LEFT), (S.ENDED, E.END)]


# -- DIRECT_HELD -> ANSWERING (recovery's heartbeat while attempt 1 rides), ANSWERING -> CANCEL --------

HEARTBEAT = b'event: keepalive\ndata: {"type":"keepalive"}\n\n'


class Outcome:
    """The run's answer through the stand-in as a body the test feeds (None: its end)."""

    def __init__(self):
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def body(self):
        while (data := await self.queue.get()) is not None:
            yield data


def test_the_stand_in_answers_while_attempt_1_rides_then_attempt_1_is_stopped(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, SSE_HEAD + chunk(EV1))
            outcome = Outcome()
            held.answer(200, "OK", SSE, outcome.body, first=HEARTBEAT)  # the heartbeat's head goes out early
            assert held.state is S.ANSWERING
            await turns_until(lambda: bool(p.to_client()))
            assert p.to_client()[0].endswith(b"\r\n\r\n" + chunk(HEARTBEAT))

            p.from_server(server, chunk(REJECTION))  # attempt 1's answer is still the run's alone
            assert len(p.to_client()) == 1
            await attempt.cancel(timeout=0.5)  # the run fails over
            assert held.state is S.ANSWERING, "attempt 1 stopped: the stand-in answers on"
            # (the table's ANSWERING-CANCEL row: the stand-in goes on answering)
            assert server in p.closed

            outcome.queue.put_nowait(EV2)
            outcome.queue.put_nowait(None)
            await turns_until(lambda: held.ended)
            assert p.to_client()[1:] == [chunk(EV2), LAST_CHUNK]
            assert not any(b"usage_limit" in w or EV1 in w for w in p.to_client())
            assert len(opened(p)) == 1 and s.stopped == 0
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.ANSWER), (S.ANSWERING, E.CANCEL), (S.ANSWERING, E.END)]


def test_attempt_1_committed_while_the_stand_in_answers_reaches_the_client_through_the_run(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            outcome = Outcome()
            held.answer(200, "OK", SSE, outcome.body, first=HEARTBEAT)
            await turns_until(lambda: bool(p.to_client()))
            p.from_server(server, SSE_HEAD + chunk(EV1))
            attempt.commit_through_hop()  # the run commits attempt 1: its items go on, its events do not
            p.from_server(server, chunk(EV2))
            p.from_server(server, LAST_CHUNK)
            assert len(p.to_client()) == 1, "nothing of the upstream's events straight to the client"
            assert items_of(attempt) == [("head", b""), ("chunk", EV1), ("chunk", EV2), ("end", b"")]
            for data in (EV1, EV2, None):  # ...the run streams them through the stand-in
                outcome.queue.put_nowait(data)
            await turns_until(lambda: held.ended)
            assert p.to_client()[1:] == [chunk(EV1), chunk(EV2), LAST_CHUNK]
            assert held.state is S.ENDED and s.stopped == 0
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.ANSWER), (S.ANSWERING, E.END)]


# -- DIRECT_HELD -> STAND_IN when attempt 1 has no connection; STAND_IN -> CANCEL ------------------------

def test_a_failed_dial_hands_the_stream_to_its_stand_in(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            p.from_client(REQUEST)
            attempt = s.direct()
            held = s.held
            await turns_until(lambda: bool(p.opening))
            server = p.open_next(error="Connection refused")
            assert held.state is S.STAND_IN and not held.riding
            assert held.taken, "the stand-in took the request"
            assert p.to(server) == [] and p.to_client() == []
            assert items_of(attempt) == [("error", b"Connection refused")]  # the run sees it and fails over
            held.answer(200, "OK", SSE, lambda: body_of(), first=EV1)
            await turns_until(lambda: held.ended)
            assert p.to_client()[0].endswith(b"\r\n\r\n" + chunk(EV1)) and p.to_client()[1:] == [LAST_CHUNK]
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.CANCEL), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


def test_a_cancel_while_the_dial_hangs_hands_the_stream_to_its_stand_in(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            p.from_client(REQUEST)
            attempt = s.direct()
            held = s.held
            await turns_until(lambda: bool(p.opening))
            await attempt.cancel(timeout=0.5)  # the run's timeout: the dial has not answered
            assert held.state is S.STAND_IN and held.taken and held.wire.waiting is None
            server = p.open_next()  # the dial answers late: nothing is sent on it
            assert p.to(server) == []
            held.answer(200, "OK", SSE, lambda: body_of(EV2), first=EV1)
            await turns_until(lambda: held.ended)
            assert p.to_client()[1:] == [chunk(EV2), LAST_CHUNK]
            assert p.to(server) == [] and s.stopped == 0
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.CANCEL), (S.STAND_IN, E.CANCEL), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


# -- CLIENT_LEFT once the client has output ------------------------------------------------------------

def test_a_client_that_leaves_a_released_stream_ends_attempt_1_and_its_upstream(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            held = s.held
            p.from_server(server, SSE_HEAD + chunk(EV1))
            items_of(attempt)
            held.release(attempt, released, EV1)
            await turns_until(lambda: bool(p.to_client()))
            sent = len(p.to(server))
            p.client_closed()
            assert held.state is S.ENDED and s.stopped == 1 and attempt.ended.is_set()
            assert server in p.closed and p.hooks[-1] == "error"
            p.from_server(server, chunk(EV2))
            await settle()
            assert len(p.to_client()) == 1 and len(p.to(server)) == sent
    play(go)
    assert moves == [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.RELEASE), (S.DIRECT_RELEASED, E.CLIENT_LEFT),
                     (S.ENDED, E.END)], "the client flow's error hook forgets the stream"


def test_a_client_that_leaves_while_the_stand_in_answers_stops_the_answer_and_the_run(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            p.from_client(REQUEST)
            held = s.held
            held.decide(False)
            await turns_until(lambda: held.taken)
            outcome = Outcome()
            held.answer(200, "OK", SSE, outcome.body, first=EV1)
            await turns_until(lambda: bool(p.to_client()))
            p.client_closed()
            assert held.state is S.ENDED and s.stopped == 1
            await turns_until(lambda: held.pump.done())
            outcome.queue.put_nowait(EV2)  # the run's next output: nobody's now
            await settle()
            assert len(p.to_client()) == 1 and opened(p) == []
    play(go)
    assert moves == [(S.CHOOSING, E.STAND_IN), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.CLIENT_LEFT),
                     (S.ENDED, E.END)], "the stopped answer's own end finds the stream ended"


# -- the client's connection goes on: its next requests, held again -------------------------------------

def test_the_next_requests_on_the_clients_connection_are_held_again(moves):
    async def go():
        with taddons.context() as tc:
            p = LayerPlay()
            tc.master.addons.add(p)
            s = Stream(p)
            attempt, server = await riding(p, s)
            first = s.held
            p.from_server(server, SSE_HEAD + chunk(EV1))
            items_of(attempt)
            first.release(attempt, released, EV1)
            await turns_until(lambda: bool(p.to_client()))
            p.from_server(server, LAST_CHUNK)
            assert first.state is S.ENDED

            mark = p.mark()  # the second: attempt 1 on the upstream connection the first one left open
            p.from_client(REQUEST)
            second = s.held
            assert second is not first and second.state is S.CHOOSING
            attempt = s.direct()
            await turns_until(lambda: len(p.since(mark, server)) > 0)
            assert p.opening == [] and len(opened(p)) == 1, "the upstream connection is reused"
            p.from_server(server, SSE_HEAD + chunk(EV2))
            items_of(attempt)
            second.release(attempt, released, EV2)
            await turns_until(lambda: bool(p.since(mark)))
            p.from_server(server, LAST_CHUNK)
            assert p.since(mark)[0].endswith(b"\r\n\r\n" + chunk(EV2)) and p.since(mark)[1:] == [LAST_CHUNK]
            assert second.state is S.ENDED

            mark = p.mark()  # the third: the stand-in's (the ended stand-ins are never reused)
            p.from_client(REQUEST)
            third = s.held
            third.decide(False)
            await turns_until(lambda: third.taken)
            third.answer(200, "OK", SSE, lambda: body_of(EV3), first=EV1)
            await turns_until(lambda: third.ended)
            assert p.since(mark)[1:] == [chunk(EV3), LAST_CHUNK] and p.since(mark, server) == []
            assert len(opened(p)) == 1 and s.stopped == 0
    play(go)
    served = [(S.CHOOSING, E.DIRECT), (S.DIRECT_HELD, E.RELEASE), (S.DIRECT_RELEASED, E.END)]
    assert moves == served + served + [(S.CHOOSING, E.STAND_IN), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


# -- an HTTP/2 client (Codex's own, through its CONNECT tunnel: its stream in a transparent HttpLayer) ----

def h2_client():
    """An HTTP/2 client (h2's own state machine) that has sent the held request on stream 1."""
    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.send_headers(1, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"api.test"),
                            (b":path", b"/v1/responses"), (b"content-type", b"application/json"),
                            (b"authorization", SECRET.encode())])
    client.send_data(1, BODY, end_stream=True)
    return client


def h2_play(tc) -> LayerPlay:
    p = LayerPlay(HTTPMode.transparent, alpn=b"h2", server=("api.test", 443))
    tc.master.addons.add(p)
    return p


def test_an_http2_clients_stream_gets_the_stand_ins_head_and_first_output_in_one_write(moves):
    import h2.events

    async def go():
        with taddons.context() as tc:
            p = h2_play(tc)
            s = Stream(p)
            client = h2_client()
            p.from_client(client.data_to_send())
            held = s.held
            assert held.state is S.CHOOSING and opened(p) == []
            for data in p.to_client():  # the connection's preface
                client.receive_data(data)
            mark = p.mark()
            held.decide(False)
            await turns_until(lambda: held.taken)
            held.answer(200, "OK", SSE, lambda: body_of(EV2), first=EV1)
            await turns_until(lambda: held.ended)
            got = [[(type(e), getattr(e, "data", None)) for e in client.receive_data(w)] for w in p.since(mark)]
            assert got[0] == [(h2.events.ResponseReceived, None), (h2.events.DataReceived, EV1)], \
                "the head and the first output in one write"
            assert got[1:] == [[(h2.events.DataReceived, EV2)], [(h2.events.DataReceived, b""), (h2.events.StreamEnded, None)]]
            assert opened(p) == [] and s.stopped == 0
    play(go)
    assert moves == [(S.CHOOSING, E.STAND_IN), (S.STAND_IN, E.ANSWER), (S.ANSWERING, E.END)]


def test_an_http2_client_that_resets_its_stream_while_the_run_chooses_stops_the_run(moves):
    async def go():
        with taddons.context() as tc:
            p = h2_play(tc)
            s = Stream(p)
            client = h2_client()
            p.from_client(client.data_to_send())
            held = s.held
            assert not held.stream_reset()
            client.reset_stream(1)
            p.from_client(client.data_to_send())
            assert held.stream_reset(), "seen in h2's own state"
            assert s.stopped == 1 and held.state is S.ENDED
            s.direct()
            await settle()
            assert opened(p) == [] and s.stopped == 1
            run_ended_unanswered(held)
    play(go)
    assert moves == [(S.CHOOSING, E.CLIENT_LEFT), (S.ENDED, E.END)]
