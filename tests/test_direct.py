"""The direct attempt (mitm/direct.py) as its layers (mitm/held_layer.py) drive it: what it keeps,
queues and hands on in each mode, the bound on what it holds, and what its record flow shows."""

from __future__ import annotations

import asyncio
import logging

import pytest
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
    wire = attempt.wire_headers(shown)
    assert wire["authorization"] == "Bearer sk-the-clients-own"
    assert "proxy-authorization" not in wire and wire["x-other"] == "1"
    assert shown["authorization"] == PLACEHOLDER  # the flow's own headers are untouched


@pytest.mark.parametrize("runs, joined", [
    ([b"a", b"b"], [b"ab"]),
    ([b"a", None, b"b"], [b"a", None, b"b"]),
])
def test_runs_of_data_are_joined_into_one_write(runs, joined):
    events = [http_layers.ResponseData(1, d) if d is not None else http_layers.ResponseEndOfMessage(1) for d in runs]
    out = held_layer._merged(events)
    assert [e.data if isinstance(e, http_layers.ResponseData) else None for e in out] == joined


REJECTED = "codex-failover: rejected: overloaded"


def test_a_served_attempt_has_no_hook_of_its_own_and_marks_the_clients_flow():
    """The client's flow is a served direct attempt's record (its request left, its answer came back):
    no hook runs for the attempt's own flow, the client's flow gets the mark, the attempt is over and
    out of the run's registry."""
    from mitmproxy.test import taddons

    seen: list[str] = []

    class Watch:
        def requestheaders(self, flow):
            seen.append("requestheaders")

        def response(self, flow):
            seen.append("response")

    async def go():
        with taddons.context(Watch()):
            attempt = make(Hop())
            attempt.registry = {attempt.flow.id: attempt}
            attempt.start()
            attempt.head_sent(attempt.flow.request, None)
            held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
            held_layer._take(attempt, http_layers.ResponseData(1, b"data: {}\n\n"))
            for _ in range(3):
                await asyncio.sleep(0)
            assert not attempt.over.is_set()  # the verdict decides what it shows
            attempt.release(lambda data: Released(data or b""), b"")  # the commit: the stream gets its head and bytes
            attempt.judge("✅", "won", None)
            assert attempt.over.is_set() and attempt.done and attempt.client_flow.marked == "✅" and attempt.served
            assert attempt.registry == {attempt.flow.id: attempt}  # in flight while its stream goes on
            held_layer._take(attempt, http_layers.ResponseEndOfMessage(1))
            assert attempt.registry == {}
            await attempt.cancel()
            for _ in range(3):
                await asyncio.sleep(0)

            # Served through the hop (the run sent the whole answer on, recovery's heartbeat): the client's
            # flow holds the hop's answer, not this attempt's: its own record is shown, marked served.
            through_hop = make(Hop())
            through_hop.start()
            through_hop.head_sent(through_hop.flow.request, None)
            held_layer._take(through_hop, http_layers.ResponseHeaders(1, sse_head(), end_stream=True))
            through_hop.commit_through_hop()
            through_hop.judge("✅", "won", None)
            await asyncio.wait_for(through_hop.over.wait(), 5)
            assert not through_hop.served and through_hop.client_flow.marked == ""
    asyncio.run(go())
    assert seen == ["requestheaders", "response"]


def test_a_losers_record_gets_an_attempts_hooks_in_order_once_its_verdict_is_in():
    """Nothing while it moves; at the verdict requestheaders, request and responseheaders (its head is
    in), the final hook once it ended, with the verdict's error; each once. A verdict that never came
    (the run ended without one: start_run gives it) shows the record too."""
    from mitmproxy.test import taddons

    seen: list[str] = []

    class Watch:
        def requestheaders(self, flow):
            seen.append("requestheaders")

        def request(self, flow):
            seen.append("request")

        def responseheaders(self, flow):
            seen.append("responseheaders")

        async def response(self, flow):  # a hook that waits: the rest follows it
            await asyncio.sleep(0)
            seen.append(f"response {flow.marked or 'unmarked'}")

        def error(self, flow):
            seen.append(f"error {flow.marked} {flow.error.msg}")

    async def turns(n: int = 3) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    async def go():
        with taddons.context(Watch()):
            attempt = make(Hop())
            attempt.start()
            attempt.head_sent(attempt.flow.request, None)
            held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))
            held_layer._take(attempt, http_layers.ResponseData(1, b"data: {}\n\n"))
            await turns()
            assert seen == []  # no verdict yet
            attempt.judge("❌", "lost", REJECTED)
            await turns()
            assert seen == ["requestheaders", "request", "responseheaders"]  # the final hook waits for the end
            assert attempt.client_flow.marked == "" and not attempt.served
            await attempt.cancel()  # the run stops it: ended
            await asyncio.wait_for(attempt.over.wait(), 5)
            assert seen[-1] == f"error ❌ {REJECTED}" and len(seen) == 4

            seen.clear()
            silent = make(Hop())
            silent.start()
            held_layer._take(silent, http_layers.ResponseHeaders(1, sse_head(), end_stream=True))  # ended at once
            await turns()
            assert seen == []
            silent.judged.set()  # no verdict came (start_run gives this when its run ends)
            await asyncio.wait_for(silent.over.wait(), 5)
            assert seen == ["requestheaders", "request", "responseheaders", "response unmarked"]
    asyncio.run(go())


def test_a_verdict_given_without_a_running_loop_holds_nothing_up_and_no_hook_runs_before_the_start():
    """`judge` from synchronous code (no loop) neither raises nor blocks the record's later hooks; an
    attempt never started gets no hook (its record still holds the real credentials) and its cancel
    does not wait for one."""
    import time as _time

    from mitmproxy.test import taddons

    seen: list[str] = []

    class Watch:
        def requestheaders(self, flow):
            seen.append(f"requestheaders {flow.request.headers['authorization']}")

        def response(self, flow):
            seen.append("response")

    unstarted = make(Hop())
    unstarted.judge("❌", "lost", REJECTED)  # no loop: nothing raised, nothing scheduled

    async def go():
        with taddons.context(Watch()):
            began = _time.monotonic()
            await unstarted.cancel(timeout=5)
            assert _time.monotonic() - began < 1 and seen == []
            attempt = make(Hop())
            attempt.start()
            attempt.head_sent(attempt.flow.request, None)
            held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=True))
            for _ in range(3):
                await asyncio.sleep(0)
            attempt.judged.set()
            for _ in range(3):
                await asyncio.sleep(0)
            assert attempt.over.is_set() and attempt.done
    asyncio.run(go())
    assert seen == [f"requestheaders {PLACEHOLDER}", "response"]


def test_moments_that_come_while_a_hook_waits_are_taken_in_order_after_it():
    """The head and the end arrive while a loser's record's `request` hook awaits: no second run of
    the hooks starts beside it; after it, responseheaders and the final hook, each once."""
    from mitmproxy.test import taddons

    seen: list[str] = []
    gate = asyncio.Event()

    class Watch:
        def requestheaders(self, flow):
            seen.append("requestheaders")

        async def request(self, flow):
            seen.append("request")
            await gate.wait()

        def responseheaders(self, flow):
            seen.append("responseheaders")

        def error(self, flow):
            seen.append("error")

    async def go():
        with taddons.context(Watch()):
            attempt = make(Hop())
            attempt.start()
            attempt.head_sent(attempt.flow.request, None)
            attempt.judge("❌", "lost", REJECTED)
            for _ in range(3):
                await asyncio.sleep(0)
            assert seen == ["requestheaders", "request"]  # and waiting
            held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=True))
            for _ in range(3):
                await asyncio.sleep(0)
            assert seen == ["requestheaders", "request"]
            gate.set()
            await asyncio.wait_for(attempt.over.wait(), 5)
            for _ in range(3):
                await asyncio.sleep(0)
    asyncio.run(go())
    assert seen == ["requestheaders", "request", "responseheaders", "error"]


def test_a_losers_record_is_settled_into_copies_of_its_own_and_a_served_ones_never_is():
    """Until its record is shown, a direct attempt's flow holds the client flow's request, the stream's
    response head and the stand-in server (a served attempt's is never shown: nothing is copied for
    it). Shown (a loser), it gets its own request as it left (placeholders, no proxy credential, the
    time it left), its own response (what the stream gets is not changed by the record's end), and a
    server of its own when its head never left. The wire's secret is masked in any log either way."""
    from codex_failover.mitm import secret_guard

    def sent(attempt: DirectAttempt) -> None:
        attempt.flow.request.headers["proxy-authorization"] = PLACEHOLDER  # what the client sent the proxy
        attempt.start()
        attempt.head_sent(attempt.flow.request, "upstream-conn")
        held_layer._take(attempt, http_layers.ResponseHeaders(1, sse_head(), end_stream=False))

    async def go():
        served = make(Hop())
        sent(served)
        assert served.flow.request is served.client_flow.request
        stream_head = served.kept[0].response
        assert served.flow.response is stream_head and served.flow.server_conn == "upstream-conn"
        served.release(lambda data: Released(data or b""), b"")
        served.judge("✅", "won", None)
        assert served.flow.request is served.client_flow.request and served.flow.response is stream_head

        loser = make(Hop())
        sent(loser)
        stream_head = loser.kept[0].response
        stream_head.timestamp_end = None  # (as a streamed head arrives: its end is still to come)
        loser.judge("❌", "lost", REJECTED)
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # its hooks began: settled
        record = loser.flow.request
        assert record is not loser.client_flow.request and "proxy-authorization" not in record.headers
        assert record.headers["authorization"] == PLACEHOLDER and record.timestamp_start == loser.sent_at
        assert loser.flow.response is not stream_head and loser.flow.response.status_code == 200
        await loser.cancel()
        await asyncio.wait_for(loser.over.wait(), 5)
        assert stream_head.timestamp_end is None and loser.flow.response.timestamp_end is not None

        unsent = make(Hop())
        unsent.start()
        unsent.connect_failed("connection refused")
        unsent.judge("🔌", "refused", "codex-failover: failed: refused")
        await asyncio.wait_for(unsent.over.wait(), 5)
        assert unsent.flow.server_conn is not unsent.client_flow.server_conn
        assert unsent.flow.server_conn.address == (unsent.flow.request.host, unsent.flow.request.port)

    secret_guard.install()
    try:
        run_with_master(go)
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
        for _ in range(3):
            await asyncio.sleep(0)
        attempt.release(lambda data: Released(data or b""), b"")
        attempt.judge("✅", "delivered", None)
        assert not attempt.served and attempt.client_flow.marked == ""
        held_layer._take(attempt, http_layers.ResponseEndOfMessage(1))
        await asyncio.wait_for(attempt.over.wait(), 5)
    run_with_master(go)
