"""The held request's driver (request_run.py) in-process, with a scripted attempt engine: each
attempt plays a script (a response head, SSE chunks, an end or a connection error) instead of
going upstream. What the client gets is read from its relay hop; what the pool learnt from health."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fake_upstream import Turn
from mitmproxy import http
from mitmproxy.test import tflow

from codex_failover.config import load_pool
from codex_failover.core.affinity import Affinity
from codex_failover.core.health import Health
from codex_failover.core.recovery import Slots
from codex_failover.core.routes import RouteHealth
from codex_failover.core.usage import UsageBook
from codex_failover.mitm.attempt import CHUNK, END, ERROR, HEAD, Item, copy_request
from codex_failover.mitm.request_run import RequestRun
from codex_failover.net.socks_bridge import SocksBridges
from codex_failover.rules_file import load_rules
from codex_failover.shared import Shared

RULES = load_rules(None)


def sse_answer(label: str) -> list[bytes]:
    turn = Turn(label, 3)
    return turn.handshake() + turn.answer()


def sse_overloaded(label: str) -> list[bytes]:
    turn = Turn(label, 3)
    return turn.handshake() + [turn.overload_error(), turn.failed("server_is_overloaded", "overloaded")]


class ScriptedAttempt:
    """What the driver uses of attempt.Attempt, playing `script`: ("head", status, headers),
    ("chunks", [bytes...]), ("end",) or ("error", message)."""

    direct = False  # (a kept-connection attempt, as attempt.Attempt says)

    def __init__(self, client_flow, request, label, n, script):
        self.flow, self.n, self.label, self.script = client_flow.copy(), n, label, script
        self.flow.request = request
        self.endpoint, self.started = None, time.monotonic()
        self.connected = self.streaming = False
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.verdict = None
        self.cancelled = False

    def start(self, via=None) -> None:
        for step in self.script:
            if step[0] == "head":
                _, status, headers = step
                self.connected = True
                self.flow.response = http.Response.make(status, b"", headers)
                self.streaming = "text/event-stream" in headers.get("content-type", "") and status == 200
                self.queue.put_nowait(Item(HEAD))
            elif step[0] == "chunks":
                for data in step[1]:
                    self.queue.put_nowait(Item(CHUNK, data))
            elif step[0] == "body":
                self.flow.response.content = step[1]
            elif step[0] == "end":
                self.queue.put_nowait(Item(END))
            elif step[0] == "error":
                self.queue.put_nowait(Item(ERROR, step[1].encode()))

    async def next(self, timeout):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None

    async def next_batch(self):
        return await self.queue.get()

    async def cancel(self, timeout: float = 5.0) -> None:
        self.cancelled = True

    def judge(self, mark, comment, error) -> None:
        self.verdict = (mark, error)


class ScriptedEngine:
    """The attempt engine of the driver (Shared.engine): the n-th attempt plays scripts[n-1]."""

    def __init__(self, scripts):
        self.scripts, self.made = scripts, []

    def attempt(self, client_flow, request, label, n):
        made = ScriptedAttempt(client_flow, request, label, n, self.scripts[len(self.made)])
        self.made.append(made)
        return made

    def prewarm(self, *args, **kwargs) -> None:
        pass


SSE = {"content-type": "text/event-stream"}


def stream(chunks, status=200) -> list:
    return [("head", status, SSE), ("chunks", chunks), ("end",)]


def whole(status: int, body: dict) -> list:
    return [("head", status, {"content-type": "application/json"}), ("body", json.dumps(body).encode()), ("end",)]


POOL = """
credentials:
  - name: spare
    api_key_env: KEY_SPARE
    base_url: https://api.example/v1
  - name: second
    api_key_env: KEY_SECOND
    base_url: https://api.example/v1
policy:
  bootstrap_timeout: 5s
  max_retry_after: 30s
"""


def shared_for(tmp_path, monkeypatch, engine, pool_text=POOL) -> Shared:
    monkeypatch.setenv("KEY_SPARE", "sk-spare")
    monkeypatch.setenv("KEY_SECOND", "sk-second")
    path = tmp_path / "pool.yaml"
    path.write_text(pool_text)
    pool = load_pool(str(path))
    health = Health()
    relay = SimpleNamespace(port=1, register=lambda session: session.token)
    return Shared(pool, RULES, health, RouteHealth(), Affinity(), UsageBook(), SocksBridges(), relay, engine,
                  attempts={}, notices=set(), recovery_slots=Slots(), upstream_tls=None)


def client_flow() -> http.HTTPFlow:
    flow = tflow.tflow()
    flow.request = http.Request.make("POST", "https://api.example/v1/responses",
                                     json.dumps({"stream": True, "input": []}).encode(),
                                     {"authorization": "Bearer sk-client", "content-type": "application/json"})
    return flow


async def answer_of(run: RequestRun) -> tuple[int, bytes]:
    """Run the request; then what its relay hop would send: status and the whole body."""
    await asyncio.wait_for(run.run(), 10)
    hop = run.client.hop
    assert hop.is_answered, "the run ended without answering its client"
    body = b"".join([chunk async for chunk in hop.body()])
    return hop.status, body


def make_run(tmp_path, monkeypatch, scripts, pool_text=POOL):
    engine = ScriptedEngine(scripts)
    shared = shared_for(tmp_path, monkeypatch, engine, pool_text)
    run = RequestRun(client_flow(), shared, {"stream": True, "input": []}, "r1")
    return run, engine, shared


def test_a_healthy_stream_is_committed_with_every_byte(tmp_path, monkeypatch):
    chunks = sse_answer("sk-client")
    run, engine, _ = make_run(tmp_path, monkeypatch, [stream(chunks)])
    status, body = asyncio.run(answer_of(run))
    assert status == 200
    assert body == b"".join(chunks), "the client must get the held bytes and the rest, in order"
    assert len(engine.made) == 1


def test_an_in_stream_rejection_fails_over_and_cools_the_credential(tmp_path, monkeypatch):
    run, engine, shared = make_run(tmp_path, monkeypatch, [stream(sse_overloaded("client")), stream(sse_answer("spare"))])
    status, body = asyncio.run(answer_of(run))
    assert status == 200
    assert b"Hello from spare" in body
    assert b"overloaded" not in body, "the rejected attempt's bytes must never reach the client"
    first, second = engine.made
    assert first.cancelled, "the rejected attempt must be cancelled"
    assert second.flow.request.headers["authorization"] == "Bearer sk-spare"
    assert [e.verdict for e in run.log.history] == ["failover", "commit"]
    cooling = [key for key, *_ in shared.health.entries() if shared.health.state(key).status == "cooling"]
    assert [k for k in cooling if k.startswith("client:")], f"the client's credential must cool: {cooling}"


def test_a_refused_connection_moves_on_without_cooling_anyone(tmp_path, monkeypatch):
    run, engine, shared = make_run(tmp_path, monkeypatch, [[("error", "Connection refused")], stream(sse_answer("spare"))])
    status, body = asyncio.run(answer_of(run))
    assert status == 200
    assert b"Hello from spare" in body
    assert [(e.verdict, e.reason) for e in run.log.history] == [("failed", "pre_dispatch"), ("commit", "output")]
    assert not list(shared.health.entries()), "a pre-dispatch failure cools nothing"


def test_an_ambiguous_failure_is_never_sent_again(tmp_path, monkeypatch):
    run, engine, _ = make_run(tmp_path, monkeypatch, [[("error", "peer closed connection")], stream(sse_answer("spare"))])
    status, body = asyncio.run(answer_of(run))
    assert status == 502
    assert len(engine.made) == 1, "the request may have reached the upstream: it must not move"
    assert b"peer closed connection" in body


def test_every_credential_rejected_answers_with_the_last_rejection_and_the_time(tmp_path, monkeypatch):
    scripts = [stream(sse_overloaded(n)) for n in ("client", "spare", "second")]
    run, engine, _ = make_run(tmp_path, monkeypatch, scripts)
    status, body = asyncio.run(answer_of(run))
    assert status == 503
    assert len(engine.made) == 3
    error = json.loads(body)["error"]
    assert error["code"] == "server_is_overloaded", error
    assert run.client.hop.headers, "the answer carries its headers"
    # One credential rests (15 s, the first of an overload streak; the others are back early: at
    # most a quarter of the pool rests for overload, and those just tried promise nothing): within
    # this pool's max_retry_after (30 s), so Retry-After says so, as the body does.
    headers = dict((k.lower(), v) for k, v in run.client.hop.headers)
    assert 10 <= error["retry_after_seconds"] <= 15, error
    assert int(headers[b"retry-after"]) == error["retry_after_seconds"], headers
    assert "The first credential is back in" in error["message"]


UNAUTHORIZED = whole(401, {"error": {"type": "invalid_request_error", "code": "invalid_api_key", "message": "bad key"}})


def test_the_clients_own_401_is_its_answer(tmp_path, monkeypatch):
    run, engine, _ = make_run(tmp_path, monkeypatch, [UNAUTHORIZED], "credentials: []\n")
    status, body = asyncio.run(answer_of(run))
    assert status == 401, body[:300]
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert len(engine.made) == 1


def test_a_pool_credentials_401_fails_over_and_takes_it_out(tmp_path, monkeypatch):
    scripts = [stream(sse_overloaded("client")), UNAUTHORIZED, stream(sse_answer("second"))]
    run, engine, shared = make_run(tmp_path, monkeypatch, scripts)
    status, body = asyncio.run(answer_of(run))
    assert status == 200, body[:300]
    assert b"Hello from second" in body
    assert len(engine.made) == 3
    assert shared.health.state("spare").status == "out", "a pool credential's 401 takes it out of rotation"


def test_an_attempts_request_copy_is_what_request_copy_makes_and_shares_nothing_mutable():
    req = tflow.tflow().request
    req.content = b'{"stream":true}'
    req.headers["authorization"] = "Bearer sk-test"
    req.stream = lambda chunk: chunk.upper()  # another addon's: not part of the request's state
    copy = copy_request(req)
    assert copy.get_state() == req.copy().get_state()
    assert copy.stream is False and req.copy().stream is False
    copy.url, copy.content = "https://elsewhere.test/v1/responses", b"{}"
    copy.headers["authorization"] = "Bearer sk-other"
    assert (req.url, req.content, req.headers["authorization"]) == ("http://address:22/path", b'{"stream":true}',
                                                                    "Bearer sk-test")



# -- what the driver does around the machine's commands (an adversarial review's findings) ---------

RECOVERY_POOL = POOL + """recovery:
  enabled: true
  attempts: 1
  heartbeat: 0
  backoff: {initial: 10ms, max: 10ms}
"""


def test_a_recovery_slot_goes_back_when_the_driver_raises_while_buffering(tmp_path, monkeypatch):
    chunks = sse_answer("client")
    script = [("head", 200, SSE), ("chunks", chunks[:9])]  # output, and the stream never ends
    run, _, shared = make_run(tmp_path, monkeypatch, [script], RECOVERY_POOL)
    real_next = ScriptedAttempt.next

    async def exploding(self, timeout):
        item = await real_next(self, min(timeout or 0.05, 0.05))
        if item is None:
            raise RuntimeError("a bug while buffering")
        return item

    monkeypatch.setattr(ScriptedAttempt, "next", exploding)
    with pytest.raises(RuntimeError):
        asyncio.run(asyncio.wait_for(run.run(), 10))
    assert shared.recovery_slots.used == 0, "a slot lost is lost for the whole process"


def test_a_run_that_ends_without_a_verdict_gives_its_attempt_one_and_its_bookkeeping_runs(tmp_path, monkeypatch):
    """A bug mid-attempt: the attempt's record must not wait for a verdict that never comes (it waits
    on no timer), and the run's done bookkeeping runs even when answering the client fails too."""
    from codex_failover.mitm.request_run import start_run

    chunks = sse_answer("client")
    run, _, _ = make_run(tmp_path, monkeypatch, [[("head", 200, SSE), ("chunks", chunks[:9])]], RECOVERY_POOL)
    real_next = ScriptedAttempt.next

    async def exploding(self, timeout):
        item = await real_next(self, min(timeout or 0.05, 0.05))
        if item is None:
            raise RuntimeError("a bug while buffering")
        return item

    def failing_answer(why):
        raise RuntimeError("and answering failed too")

    monkeypatch.setattr(ScriptedAttempt, "next", exploding)
    done: list = []

    async def go():
        task = start_run(run, done.append)
        monkeypatch.setattr(run.client, "internal_error", failing_answer)
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(task, 10)
        await asyncio.sleep(0)  # its done callback
    asyncio.run(go())
    assert run.current is not None and not run.log.history  # no verdict was given
    assert done == [run]


def test_a_direct_attempt_whose_run_ended_without_a_verdict_is_given_one(tmp_path, monkeypatch):
    """Its record's hooks wait for a verdict on no timer (direct.py): the run's end gives it."""
    from codex_failover.mitm.request_run import start_run

    run, _, _ = make_run(tmp_path, monkeypatch, [stream(sse_answer("client"))])
    from codex_failover.mitm.direct import DirectAttempt

    class Unjudged(DirectAttempt):
        def __init__(self):  # (nothing of a real attempt is asked)
            self.judged = asyncio.Event()

        def unjudged(self):
            self.judged.set()

    direct = Unjudged()

    async def bug():
        run.current = direct
        raise RuntimeError("a bug before any verdict")

    monkeypatch.setattr(run, "run", bug)
    monkeypatch.setattr(run, "hold", lambda: None)
    monkeypatch.setattr(run.client, "internal_error", lambda why: None)

    async def go():
        await asyncio.wait_for(start_run(run, lambda _run: None), 10)
        await asyncio.sleep(0)
    asyncio.run(go())
    assert direct.judged.is_set()


def test_a_client_gone_before_its_first_output_is_recorded_so_and_homes_no_session(tmp_path, monkeypatch):
    run, _, shared = make_run(tmp_path, monkeypatch, [stream(sse_answer("client"))])

    async def cancelled(timeout=0.05):
        raise asyncio.CancelledError()

    monkeypatch.setattr(run.client, "first_output", cancelled)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asyncio.wait_for(run.run(), 10))
    assert [(e.verdict, e.reason) for e in run.log.history] == [("cancelled", "client_gone")]
    assert shared.affinity.get(run.session) is None, "nothing was served: no session's new home"


def test_the_connect_deadline_runs_from_the_attempts_start(tmp_path, monkeypatch):
    """Building the attempt's way (a SOCKS bridge starting, say) is not the upstream's time to connect."""
    from codex_failover.mitm import attempt_maker

    pool = POOL.replace("  bootstrap_timeout: 5s", "  bootstrap_timeout: 5s\n  connect_timeout: 1s")
    run, engine, _ = make_run(tmp_path, monkeypatch, [stream(sse_answer("client"))], pool)

    class SlowToConnect(ScriptedAttempt):
        def start(self, via=None) -> None:  # its head comes 0.5 s after it started
            asyncio.get_running_loop().call_later(0.5, ScriptedAttempt.start, self, via)

    def attempt(client_flow, request, label, n):
        engine.made.append(SlowToConnect(client_flow, request, label, n, engine.scripts[len(engine.made)]))
        return engine.made[-1]

    engine.attempt = attempt

    async def slow_via(self, ep):
        await asyncio.sleep(0.7)

    monkeypatch.setattr(attempt_maker.AttemptMaker, "via", slow_via)
    status, _ = asyncio.run(answer_of(run))
    assert status == 200
    assert [(e.verdict, e.reason) for e in run.log.history] == [("commit", "output")]


def test_a_finished_run_lets_its_parsed_body_go_while_the_run_is_still_referenced(tmp_path, monkeypatch):
    """A run sits in reference cycles that only a full collection breaks, which under load comes
    tens of finished requests later: its parsed body (a Codex request is the whole conversation)
    must be freed by reference counting when the run ends, not then."""
    import gc
    import weakref

    from codex_failover.mitm.request_run import start_run

    class Body(dict):  # a dict that can be watched
        pass

    engine = ScriptedEngine([stream(sse_answer("sk-client"))])
    shared = shared_for(tmp_path, monkeypatch, engine)
    body = Body(stream=True, input=[{"type": "message", "role": "user", "content": "x" * 10_000}])
    run = RequestRun(client_flow(), shared, body, "r1")
    watched = weakref.ref(body)
    del body

    async def go():
        task = start_run(run, lambda _run: None)
        await asyncio.wait_for(task, 10)
        await asyncio.sleep(0)  # its done callback

    gc.disable()  # no collection may free it: only the run's own letting go
    try:
        asyncio.run(go())
        assert run.client.hop.is_answered
        assert watched() is None, "the finished run still holds its parsed body"
    finally:
        gc.enable()


def test_a_committed_stream_lets_its_parsed_body_go_while_it_is_still_live(tmp_path, monkeypatch):
    """No attempt follows a commit, and a committed stream lives as long as its answer (minutes for
    a long Codex turn, whose body is the whole conversation): the parsed body goes at the commit."""
    import weakref

    class Body(dict):  # a dict that can be watched
        pass

    chunks = sse_answer("sk-client")
    engine = ScriptedEngine([[("head", 200, SSE), ("chunks", chunks[:-1])]])  # no end yet: the stream is live
    shared = shared_for(tmp_path, monkeypatch, engine)
    body = Body(stream=True, input=[{"type": "message", "role": "user", "content": "x" * 10_000}])
    run = RequestRun(client_flow(), shared, body, "r1")
    watched = weakref.ref(body)
    del body

    async def go():
        task = asyncio.get_running_loop().create_task(run.run())
        for _ in range(200):
            if run.winner is not None:
                break
            await asyncio.sleep(0.01)
        assert run.winner is not None, "the stream was not committed"
        assert watched() is None, "a committed stream still holds its parsed body"
        engine.made[0].queue.put_nowait(Item(CHUNK, chunks[-1]))
        engine.made[0].queue.put_nowait(Item(END))
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    assert run.client.hop.is_answered


def test_the_held_client_keeps_no_way_back_to_its_run(monkeypatch):
    """The run holds its held client; the client handed the run's abort to its hop and keeps none
    itself, so a finished run (its hop detached) is freed by reference counting, not the collector."""
    import gc
    import weakref

    from codex_failover.mitm import held_client

    class Run:
        def abort(self) -> None:
            pass

    run = Run()
    client = held_client.HeldClient(client_flow(), None, run.abort)
    monkeypatch.setattr(held_client.HeldStream, "attach", staticmethod(lambda flow, abort: object()))
    client.hold()
    run.client = client
    watched = weakref.ref(run)
    gc.disable()  # no collection may free it
    try:
        del run, client
        assert watched() is None, "the held client keeps its run alive in a cycle"
    finally:
        gc.enable()
