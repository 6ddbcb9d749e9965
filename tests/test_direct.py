"""The direct attempt (mitm/direct.py) as its layers (mitm/held_layer.py) drive it: what it keeps,
queues and hands on in each mode, the bound on what it holds, and what its record flow shows."""

from __future__ import annotations

import asyncio
import logging

from mitmproxy import http
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.test import tflow

from codex_failover.core.after_output import Released
from codex_failover.mitm import bounded_body, held_layer
from codex_failover.mitm.attempt import PLACEHOLDER, copy_request, hide_secrets
from codex_failover.mitm.direct import DirectAttempt, Mode


class Hop:
    """What a DirectAttempt asks of its hop."""

    def __init__(self):
        self.direct = None
        self.reading: list[bool] = []  # what set_reading was asked
        self.choices: list[bool] = []
        self.cancelled = 0
        self.left: list[str] = []

    def decide(self, direct: bool) -> None:
        self.choices.append(direct)

    async def cancel_direct(self) -> None:
        self.cancelled += 1

    def client_left(self, why: str) -> None:
        self.left.append(why)

    def set_reading(self, server, on: bool) -> None:
        self.reading.append(on)


def sse_head(ctype: bytes = b"text/event-stream", status: int = 200) -> http.Response:
    return http.Response.make(status, b"", {"content-type": ctype.decode()})


def make(hop: Hop) -> DirectAttempt:
    flow = tflow.tflow()
    flow.request.headers["authorization"] = "Bearer sk-the-clients-own"
    original = copy_request(flow.request)
    hide_secrets(flow.request)  # as the run does before its first attempt
    return DirectAttempt(flow, "r1#1", 1, hop, original)


def run_with_master(go) -> None:
    """Run `go()` with a test master (the record's hooks run at the loop's turns)."""
    from mitmproxy.test import taddons

    async def outer():
        with taddons.context():
            await go()
            await asyncio.sleep(0)  # the record's due hooks
    asyncio.run(outer())


def items(attempt: DirectAttempt) -> list[tuple[str, bytes]]:
    out = []
    while not attempt.queue.empty():
        item = attempt.queue.get_nowait()
        out.append((item.kind, item.data))
    return out


def test_holding_keeps_every_event_and_queues_it_for_the_run():
    async def go():
        hop = Hop()
        attempt = make(hop)
        attempt.start()
        assert hop.direct is attempt and hop.choices == [True]
        events = [http_layers.ResponseHeaders(1, sse_head(), end_stream=False),
                  http_layers.ResponseData(1, b"data: {}\n\n"), http_layers.ResponseData(1, b"data: 2\n\n"),
                  http_layers.ResponseEndOfMessage(1)]
        assert [held_layer._take(attempt, e) for e in events] == [[]] * 4  # nothing to the stream yet
        assert attempt.kept == events
        assert items(attempt) == [("head", b""), ("chunk", b"data: {}\n\n"), ("chunk", b"data: 2\n\n"), ("end", b"")]
        assert attempt.streaming and attempt.finished and attempt.ended.is_set()
        assert attempt.flow.request.headers["authorization"] == PLACEHOLDER  # the record shows no secret
    run_with_master(go)


def test_a_body_that_is_not_streamed_is_read_whole_as_mitmproxy_reads_it():
    async def go():
        attempt = make(Hop())
        attempt.start()
        for e in [http_layers.ResponseHeaders(1, sse_head(b"application/json", 429), end_stream=False),
                  http_layers.ResponseData(1, b'{"error":'), http_layers.ResponseData(1, b' {}}'),
                  http_layers.ResponseEndOfMessage(1)]:
            held_layer._take(attempt, e)
        assert items(attempt) == [("head", b""), ("end", b"")]  # the run's ReadWhole: no chunk items
        assert attempt.flow.response.raw_content == b'{"error": {}}'
    run_with_master(go)


def test_a_release_hands_over_what_was_kept_and_then_lets_every_event_pass():
    async def go():
        attempt = make(Hop())
        attempt.start()
        head, first = http_layers.ResponseHeaders(1, sse_head(), end_stream=False), http_layers.ResponseData(1, b"a")
        held_layer._take(attempt, head)
        held_layer._take(attempt, first)
        attempt.queue.get_nowait()  # the run read the head, not the chunk yet
        fed: list[bytes | None] = []

        def feed(data):
            fed.append(data)
            return Released(data or b"")
        assert attempt.release(feed, b"") == ([head, first], b"a")  # the held head, the bytes for the stream
        assert fed == [b"a"] and attempt.mode is Mode.RELEASED  # the machine sees what it had not read
        assert held_layer._take(attempt, http_layers.ResponseData(1, b"b")) == [http_layers.ResponseData(1, b"b")]
        end = http_layers.ResponseEndOfMessage(1)
        assert held_layer._take(attempt, end) == [end]
        assert fed == [b"a", b"b", None] and attempt.queue.empty()
    run_with_master(go)


def test_a_released_stream_gets_what_its_machine_releases_and_is_cut_where_it_says():
    """Released, each chunk passes as the committed machine releases it (whole events); at a cut (a
    rejection after the output began) the attempt takes nothing more, and the layers end the stream."""
    from codex_failover.core.classifier import Decision
    from codex_failover.core.vocabulary import Verdict

    async def go():
        attempt = make(Hop())
        attempt.start()
        held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
        answers = iter([Released(b"data: 1\n\n"), Released(b"", Decision(Verdict.FAILOVER, "overloaded", "error", {}))])
        attempt.release(lambda data: next(answers), b"")
        assert held_layer._take(attempt, http_layers.ResponseData(1, b"data: 1\n\ndata: 2")) == \
            [http_layers.ResponseData(1, b"data: 1\n\n")]  # the rest of an event waits for its end
        assert held_layer._take(attempt, http_layers.ResponseData(1, b"\n\ndata: {error}")) == []
        assert attempt.mode is Mode.CUTTING and attempt.ended.is_set()
        del attempt.flow.response.headers["content-length"]  # (Response.make states one; a stream has none)
        assert held_layer._cut_end(attempt, 1) == [http_layers.ResponseEndOfMessage(1)]
        attempt.mode = Mode.CUT  # (the layers passed its end)
        assert held_layer._take(attempt, http_layers.ResponseData(1, b"more")) == []
        assert held_layer._take(attempt, http_layers.ResponseEndOfMessage(1)) == []
        attempt.flow.response.headers["content-length"] = "999"  # a stated length: cut off instead
        assert isinstance(held_layer._cut_end(attempt, 1)[0], http_layers.ResponseProtocolError)
    run_with_master(go)


def test_a_cancel_hands_the_stream_to_its_hop_and_takes_nothing_more():
    from mitmproxy.test import taddons

    seen: list[str] = []

    class Watch:
        def error(self, flow):
            seen.append(f"error {flow.error.msg}")

    async def go():
        with taddons.context(Watch()):
            hop = Hop()
            attempt = make(hop)
            attempt.start()
            held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
            await attempt.cancel()
            assert hop.cancelled == 1 and attempt.mode is Mode.DROPPED and attempt.kept == []
            assert attempt.flow.error.msg == "attempt cancelled by codex-failover"
            assert held_layer._take(attempt, http_layers.ResponseData(1, b"late")) == []
            await asyncio.wait_for(attempt.over.wait(), 5)  # the record got its final hook
    asyncio.run(go())
    assert seen == ["error attempt cancelled by codex-failover"]


def test_what_it_holds_is_bounded_by_failover_max_body(monkeypatch):
    monkeypatch.setattr(bounded_body, "limit", 10)

    async def go():
        attempt = make(Hop())
        attempt.start()
        held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
        held_layer._take(attempt, http_layers.ResponseData(1, b"x" * 11))
        assert ("error", b"the held response passed failover_max_body") in items(attempt)
    run_with_master(go)


def test_the_wire_gets_the_clients_own_values_and_no_proxy_authorization():
    attempt = make(Hop())
    attempt._hide_secrets()
    shown = http.Headers([(b"authorization", PLACEHOLDER.encode()), (b"proxy-authorization", b"Basic eDp5"),
                          (b"x-other", b"1")])
    wire = attempt.wire_head(shown)
    assert wire["authorization"] == "Bearer sk-the-clients-own"
    assert "proxy-authorization" not in wire and wire["x-other"] == "1"
    assert shown["authorization"] == PLACEHOLDER  # the flow's own headers are untouched


REJECTED = "codex-failover: rejected: overloaded"


class Watch:
    """The hooks a record flow gets, in order, and what its request showed then."""

    def __init__(self):
        self.seen: list[str] = []

    def requestheaders(self, flow):
        self.seen.append(f"requestheaders {flow.request.headers.get('authorization')}")

    def request(self, flow):
        self.seen.append("request")

    def responseheaders(self, flow):
        self.seen.append("responseheaders")

    async def response(self, flow):  # a hook that waits: the rest follows it
        await asyncio.sleep(0)
        self.seen.append(f"response {flow.marked or 'unmarked'}")

    def error(self, flow):
        self.seen.append(f"error {flow.marked} {flow.error.msg}")


def sent(attempt: DirectAttempt, end_stream: bool = False) -> None:
    attempt.flow.request.headers["proxy-authorization"] = PLACEHOLDER  # what the client sent the proxy
    attempt.start()
    attempt.head_sent(attempt.flow.request, "upstream-conn")
    held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=end_stream))


def released(attempt: DirectAttempt) -> DirectAttempt:
    """`attempt` sent, a chunk of its answer held, then committed on the client's stream."""
    sent(attempt)
    held_layer._take(attempt, http_layers.ResponseData(1, b"data: {}\n\n"))
    attempt.release(lambda data: Released(data or b""), b"")
    return attempt


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_served_attempt_has_no_hook_of_its_own_and_marks_the_clients_flow():
    """The client's flow is a served direct attempt's record (its request left, its answer came back):
    no hook runs for the attempt's own flow, nothing is copied for it, the client's flow gets the mark,
    the attempt is over, and out of the run's registry once its stream ended (no task waits for that:
only a loser's record gets one, once its verdict is in). Served through the hop
    (recovery's heartbeat), the client's flow holds the hop's answer: its own record is shown."""
    from mitmproxy.test import taddons

    watch = Watch()

    async def go():
        with taddons.context(watch):
            attempt = make(Hop())
            attempt.registry = {attempt.flow.id: attempt}
            sent(attempt)
            stream_head = attempt.kept[0].response
            held_layer._take(attempt, http_layers.ResponseData(1, b"data: {}\n\n"))
            attempt.release(lambda data: Released(data or b""), b"")  # the commit: the stream gets its head and bytes
            attempt.judge("✅", "won", None)
            assert attempt.over.is_set() and attempt.client_flow.marked == "✅" and attempt.served
            assert attempt.flow.request is attempt.client_flow.request and attempt.flow.response is stream_head
            await turns()
            assert attempt.registry == {attempt.flow.id: attempt}  # in flight while its stream goes on
            held_layer._take(attempt, http_layers.ResponseEndOfMessage(1))
            attempt.done_streaming()  # the client flow's final hook: its stream ended
            assert attempt.registry == {}
            await attempt.cancel()
            await turns()

            through_hop = make(Hop())
            sent(through_hop, end_stream=True)
            through_hop.commit_through_hop()
            through_hop.judge("✅", "won", None)
            await asyncio.wait_for(through_hop.over.wait(), 5)
            assert not through_hop.served and through_hop.client_flow.marked == ""
    asyncio.run(go())
    assert watch.seen == [f"requestheaders {PLACEHOLDER}", "request", "responseheaders", "response ✅"]


def test_a_served_attempt_whose_stream_ended_before_its_verdict_still_has_no_hook_of_its_own():
    """A short stream may reach its end (the client flow's response hook: done_streaming) before the
    run records the commit: the attempt served all the same, and its record is the client's flow."""
    from mitmproxy.test import taddons

    watch = Watch()

    async def go():
        with taddons.context(watch):
            attempt = released(make(Hop()))
            held_layer._take(attempt, http_layers.ResponseEndOfMessage(1))
            attempt.done_streaming()  # the stream's end came first
            attempt.judge("✅", "won", None)
            await turns()
            assert attempt.served and attempt.client_flow.marked == "✅"
    asyncio.run(go())
    assert watch.seen == []


def test_a_released_attempt_cancelled_before_any_verdict_is_shown_when_its_run_ends_without_one():
    """A released attempt the run stops before its verdict (a bug's path): the cancel is no verdict, so
    the run's end (`unjudged`) shows its record as it is, once; a served one's end shows nothing."""
    from mitmproxy.test import taddons

    watch = Watch()

    async def go():
        with taddons.context(watch):
            stopped = released(make(Hop()))
            await stopped.cancel()
            await turns()
            assert watch.seen == [] and stopped.record is None, "a cancel of a released attempt is no verdict"
            held_layer._take(stopped, http_layers.ResponseEndOfMessage(1))
            stopped.unjudged()  # its run ended without a verdict
            stopped.unjudged()
            await asyncio.wait_for(stopped.over.wait(), 5)
            assert watch.seen == [f"requestheaders {PLACEHOLDER}", "request", "responseheaders", "response unmarked"]

            watch.seen.clear()
            served = make(Hop())
            sent(served)
            served.release(lambda data: Released(data or b""), b"")
            served.judge("✅", "won", None)
            served.unjudged()
            await turns()
            assert watch.seen == [] and served.record is None
    asyncio.run(go())


def test_a_losers_record_is_its_own_copy_and_gets_an_attempts_hooks_once_it_ended():
    """At the verdict a loser's record gets a request and a response of its own (the client flow's
    request and the stream's head stay as they are): placeholders, no proxy credential, the time it
    left. Its hooks run once it ended, in an attempt's order through mitmproxy's dispatch, the final
    one with the verdict's error. An attempt that never sent gets a server connection of its own; a
    verdict that never came (start_run gives `judged` when its run ends) shows the record too; an
    attempt never started gets no hook (its record still holds the real credentials)."""
    from mitmproxy.test import taddons

    watch = Watch()

    async def go():
        with taddons.context(watch):
            loser = make(Hop())
            sent(loser)
            stream_head = loser.kept[0].response
            stream_head.timestamp_end = None  # (as a streamed head arrives: its end is still to come)
            await turns()
            loser.judge("❌", "lost", REJECTED)
            record = loser.flow.request
            assert record is not loser.client_flow.request and "proxy-authorization" not in record.headers
            assert record.headers["authorization"] == PLACEHOLDER and record.timestamp_start == loser.sent_at
            assert loser.flow.response is not stream_head and loser.flow.response.status_code == 200
            await turns()
            assert watch.seen == [] and loser.client_flow.marked == ""  # the hooks wait for its end
            await loser.cancel()  # the run stops it: ended
            await asyncio.wait_for(loser.over.wait(), 5)
            assert watch.seen == [f"requestheaders {PLACEHOLDER}", "request", "responseheaders", f"error ❌ {REJECTED}"]
            assert stream_head.timestamp_end is None and loser.flow.response.timestamp_end is not None

            watch.seen.clear()
            unsent = make(Hop())
            unsent.start()
            unsent.connect_failed("connection refused")
            unsent.judge("🔌", "refused", "codex-failover: failed: refused")
            await asyncio.wait_for(unsent.over.wait(), 5)
            assert unsent.flow.server_conn is not unsent.client_flow.server_conn
            assert unsent.flow.server_conn.address == (unsent.flow.request.host, unsent.flow.request.port)
            assert watch.seen == [f"requestheaders {PLACEHOLDER}", "request", "error 🔌 codex-failover: failed: refused"]

            watch.seen.clear()
            silent = make(Hop())
            sent(silent, end_stream=True)
            silent.unjudged()  # no verdict came (its run ended without one)
            await asyncio.wait_for(silent.over.wait(), 5)
            assert watch.seen == [f"requestheaders {PLACEHOLDER}", "request", "responseheaders", "response unmarked"]

            watch.seen.clear()
            unstarted = make(Hop())
            unstarted.registry = {unstarted.flow.id: unstarted}
            unstarted.judge("❌", "lost", REJECTED)
            await asyncio.wait_for(unstarted.cancel(timeout=5), 1)  # nothing to wait for
            await turns()
            assert watch.seen == [] and unstarted.registry == {}
    asyncio.run(go())


def test_the_wire_secret_is_masked_in_any_log_once_started():
    from codex_failover.mitm import secret_guard

    secret_guard.install()
    try:
        flow = tflow.tflow()
        flow.request.headers["authorization"] = "Bearer opaque7f3e9a1c"  # no key shape: masked only if armed
        original = copy_request(flow.request)
        hide_secrets(flow.request)

        async def armed():
            DirectAttempt(flow, "r2#1", 1, Hop(), original).start()
        run_with_master(armed)
        record = logging.getLogRecordFactory()("t", logging.INFO, __file__, 1, "saw opaque7f3e9a1c", (), None)
        assert "opaque7f3e9a1c" not in record.getMessage()
    finally:
        secret_guard.uninstall()


def test_a_verdict_that_serves_after_the_record_began_to_show_leaves_that_record_as_it_is_shown():
    """Recovery: attempt 1 was recorded retried (its record shown), then delivered after all: the
    exchange stays shown once, in its own record; the client's flow is not marked as its record."""
    async def go():
        attempt = make(Hop())
        attempt.start()
        attempt.head_sent(attempt.flow.request, None)
        held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
        attempt.judge("🔄", "retried", "codex-failover: retried: no terminal event")
        await turns()
        attempt.release(lambda data: Released(data or b""), b"")
        attempt.judge("✅", "delivered", None)
        assert not attempt.served and attempt.client_flow.marked == ""
        held_layer._take(attempt, http_layers.ResponseEndOfMessage(1))
        await asyncio.wait_for(attempt.over.wait(), 5)
    run_with_master(go)
