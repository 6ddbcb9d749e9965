"""The request machine (core/request_machine.py, core/attempt_machine.py) path by path, on an
injected clock: every per-request decision the shell made before (commit, in-stream failover,
recovery, synchronous 5xx/429 with and without cooling, pre-dispatch move, ambiguous failure, the
client gone, exhaustion) and a WebSocket turn's move, reconnect and exhaustion.

Each case drives the machine with a script of events per attempt and compares the transcript of
its steps and commands, then what the pool learnt."""

from __future__ import annotations

import json

import pytest
from conftest import Clock
from fake_upstream import OVERLOADED, Turn

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.affinity import Affinity
from codex_failover.core.attempt_events import (
    Broke,
    Cancel,
    Chunk,
    Commit,
    End,
    Head,
    Heartbeat,
    ReadWhole,
    Record,
    Respond,
    Scope,
    Succeeded,
    Tick,
    Whole,
)
from codex_failover.core.auth import APIKEY, AuthMaterial
from codex_failover.core.cooldown_policy import OverloadPolicy
from codex_failover.core.failover_loop import FailoverLoop
from codex_failover.core.health import Health
from codex_failover.core.outcomes import AllCooling, Exhausted, Final, Rejection, Try, Wait
from codex_failover.core.planner import make_plan
from codex_failover.core.pool_feedback import PoolFeedback
from codex_failover.core.provenance import RESPONSE, Provenance, artifacts_of_output, item_keys
from codex_failover.core.recovery import RecoveryPolicy, Slots
from codex_failover.core.request_machine import Done, GiveUp, RequestMachine
from codex_failover.core.routes import RouteHealth, parse_routes
from codex_failover.core.turn_machine import (
    TRANSITIONS,
    TurnEvent,
    TurnMachine,
    TurnState,
    cannot_go_home,
    client_close_after_upstream,
    client_close_at_end,
    exhausted_answer,
    goes_home,
    upstream_close_after_client,
)
from codex_failover.core.usage import UsageBook
from codex_failover.rules_file import load_rules

RULES = load_rules(None)
CLIENT = AuthMaterial(APIKEY, "tok-client")
SSE = {"content-type": "text/event-stream"}
JSON = {"content-type": "application/json"}


def cred(name: str) -> Credential:
    return Credential(name, AuthMaterial(APIKEY, f"tok-{name}"), "https://api.example/v1", "$X")


def answer(label: str = "a") -> bytes:
    turn = Turn(label, 2)
    return b"".join(turn.handshake() + turn.answer())


def overloaded() -> bytes:
    turn = Turn("x", 2)
    return b"".join(turn.handshake() + [turn.overload_error(), turn.failed("server_is_overloaded", "overloaded")])


def failed_in_stream() -> bytes:
    """Output, then a stream that ends in a terminal error recovery may retry."""
    turn = Turn("x", 2)
    return b"".join(turn.handshake() + turn.answer()[:3] + [turn.failed("server_error", "boom")])


def error_body(status_error: dict) -> bytes:
    return json.dumps({"error": status_error}).encode()


class World:
    def __init__(self, creds=("a", "b"), use_client=False, recovery=None, routes=None, **policy):
        self.clock = Clock()
        self.health = Health(self.clock)
        self.route_health = RouteHealth(floor=30, cap=300, clock=self.clock)
        policy.setdefault("overload", OverloadPolicy(first=60.0, factor=1.0, max=60.0, max_held_out=1.0))
        policy.setdefault("bootstrap_timeout", 10.0)
        self.pool = PoolConfig(tuple(cred(c) for c in creds), Policy(use_client_credential=use_client, **policy),
                               routes=parse_routes(routes), recovery=recovery or RecoveryPolicy())
        self.feedback = PoolFeedback(self.health, Affinity(clock=self.clock), UsageBook(), pool_size=len(creds))
        self.provenance = Provenance(clock=self.clock)
        self.slots = Slots()
        self.told: list[str] = []

    def scope(self, compact: bool = False) -> Scope:
        return Scope(RULES, self.pool, self.feedback, self.provenance, self.slots, self.clock, compact,
                       "session-1", CLIENT, "[r1] ", lambda level, text: self.told.append(text))

    def machine(self, compact: bool = False) -> RequestMachine:
        loop = FailoverLoop(lambda: make_plan(CLIENT, self.pool, self.health, True), self.health, self.route_health,
                            self.pool, clock=self.clock, rand=lambda: 0.5)
        return RequestMachine(loop, self.scope(compact))

    def cooling(self) -> dict[str, str]:
        return {name: self.health.state(name).reason for name in ("a", "b") if self.health.state(name).status == "cooling"}


def show(command) -> str:
    match command:
        case Record(verdict, reason, status, _):
            return f"record {verdict} {reason} {status}"
        case Commit(held, ended, error, _):
            return f"commit {len(held)}b" + (" ended" if ended else "") + (f" broken({error})" if error else "")
        case Heartbeat(seconds):
            return f"heartbeat {seconds:g}"
        case Cancel():
            return "cancel"
        case ReadWhole():
            return "read whole"
        case Respond():
            return "respond"
        case Succeeded():
            return "succeeded"
    raise AssertionError(command)


def drive(world: World, scripts: list[list], machine: RequestMachine | None = None, gone_at: int | None = None) -> list[str]:
    """Run the machine: each Try plays the next script (events, or a number: seconds on the clock)."""
    m = machine or world.machine()
    out: list[str] = []
    queue = list(scripts)
    for _ in range(50):
        step = m.next()
        match step:
            case Try(cand, _, n):
                out.append(f"try {n} {cand.name}")
                assert m.attempt is not None
                for event in queue.pop(0):
                    if isinstance(event, (int, float)):
                        world.clock.now += event
                        continue
                    if event == "gone":
                        out += [show(c) for c in m.client_gone()]
                        return out + ["client gone"]
                    if m.attempt.over:  # committed: the rest is the live stream's
                        assert isinstance(event, (Chunk, End)), event
                        m.attempt.live(event.data if isinstance(event, Chunk) else None)
                        continue
                    for command in m.attempt.send(event):
                        if isinstance(command, Succeeded):  # what the shell does with it
                            m.attempt.succeeded()
                        out.append(show(command))
                assert m.attempt.over, f"attempt {n} not over: {out}"
            case Wait(seconds, _):
                out.append(f"wait {seconds:g}")
                world.clock.now += seconds
            case Done():
                return out + ["done"]
            case GiveUp(commands, why):
                return out + [f"give up ({why}): " + ", ".join(show(c) for c in commands)]
            case Exhausted(last, _, _):
                return out + [f"exhausted ({last.reason} {last.status})"]
            case AllCooling():
                return out + ["all cooling"]
            case Final(rejection):
                return out + [f"final ({rejection.reason})"]
            case other:
                out.append(type(other).__name__)
    raise AssertionError(f"no end: {out}")


def stream(body: bytes, status: int = 200) -> list:
    return [Head(status, SSE, True), Chunk(body), End()]


def whole(status: int, body: bytes) -> list:
    return [Head(status, JSON, False), Whole(body)]


OVERLOAD_JSON = error_body(OVERLOADED)
HELLO = Turn("a", 1).handshake()[0]
KEEPALIVE = b": keepalive\n\n"
OVERLOAD_EVENT = Turn("a", 1).overload_error()
USAGE_LIMIT = error_body({"type": "usage_limit_reached", "code": "usage_limit_reached", "message": "limit",
                          "resets_in_seconds": 3600})

# (name, world options, scripts, transcript, cooling after)
CASES = [
    ("commit", {}, [stream(answer())],
     ["try 1 a", f"commit {len(answer())}b", "succeeded", "record commit output 200", "done"], {}),
    ("in-stream overload moves and cools", {}, [stream(overloaded()), stream(answer("b"))],
     ["try 1 a", "record failover overloaded 200", "cancel", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {"a": "overloaded"}),
    ("synchronous 503 overload moves and cools", {}, [whole(503, OVERLOAD_JSON), stream(answer("b"))],
     ["try 1 a", "read whole", "record failover overloaded 503", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {"a": "overloaded"}),
    ("synchronous 429 usage limit moves and cools", {}, [whole(429, USAGE_LIMIT), stream(answer("b"))],
     ["try 1 a", "read whole", "record failover usage_limit 429", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {"a": "usage_limit"}),
    ("a bare 502 moves and cools nothing", {}, [whole(502, b""), stream(answer("b"))],
     ["try 1 a", "read whole", "record failover upstream_5xx 502", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),
    ("another 4xx is delivered as is", {}, [whole(400, error_body({"type": "invalid_request_error", "message": "bad"}))],
     ["try 1 a", "read whole", "respond", "succeeded", "record deliver client_error 400", "done"], {}),
    ("refused before dispatch moves", {}, [[Broke("[Errno 111] Connect call failed")], stream(answer("b"))],
     ["try 1 a", "record failed pre_dispatch None", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),
    ("never connected within connect_timeout moves", {"connect_timeout": 5.0},
     [[5, Tick(connected=False)], stream(answer("b"))],
     ["try 1 a", "record failed pre_dispatch None", "cancel", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),
    ("a stream an HTTP/2 GOAWAY left unprocessed moves, cooling nothing", {},
     [[Broke("HTTP/2 GOAWAY: the server never processed this stream")], stream(answer("b"))],
     ["try 1 a", "record failed not_processed None", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),
    ("the only credential's unprocessed stream is sent again after a backoff", {"_creds": ("a",)},
     [[Broke("HTTP/2 GOAWAY: the server never processed this stream")], stream(answer())],
     ["try 1 a", "record failed not_processed None", "wait 0.5", "try 2 a",
      f"commit {len(answer())}b", "succeeded", "record commit output 200", "done"], {}),
    ("an ambiguous failure never moves", {}, [[Broke("connection reset by peer")]],
     ["try 1 a", "record failed ambiguous None", "final (ambiguous)"], {}),
    ("TLS verification fails closed", {}, [[Broke("certificate verify failed")]],
     ["try 1 a", "record failed tls_failed None", "final (tls_failed)"], {}),
    ("no head within response_timeout never moves", {"connect_timeout": 5.0, "response_timeout": 30.0},
     [[5, Tick(connected=True), 25, Tick(connected=True)]],
     ["try 1 a", "record failed response_timeout None", "cancel", "final (response_timeout)"], {}),
    ("a whole body that never completes never moves", {}, [[Head(200, JSON, False), Whole(None)]],
     ["try 1 a", "read whole", "record failed incomplete_response None", "cancel", "final (incomplete_response)"], {}),
    ("every credential overloaded: exhausted", {}, [stream(overloaded()), stream(overloaded())],
     ["try 1 a", "record failover overloaded 200", "cancel", "try 2 b", "record failover overloaded 200", "cancel",
      "exhausted (overloaded 200)"], {"a": "overloaded", "b": "overloaded"}),
    ("the client leaves while held", {}, [[Head(200, SSE, True), "gone"]],
     ["try 1 a", "record cancelled client_gone None", "cancel", "client gone"], {}),
    ("a stream that breaks while held is delivered, then the break", {},
     [[Head(200, SSE, True), Chunk(HELLO), Broke("reset")]],
     ["try 1 a", f"commit {len(HELLO)}b broken(reset)", "succeeded", "record commit upstream_broken 200", "done"], {}),
    ("the bootstrap window's time runs out with no extended hold: commit", {"bootstrap_timeout": 2.0,
                                                                             "first_event_timeout": 0.0},
     [[Head(200, SSE, True), Chunk(Turn("a", 1).handshake()[0]), 2, Tick()]],
     ["try 1 a", f"commit {len(Turn('a', 1).handshake()[0])}b", "succeeded", "record commit timeout 200", "done"], {}),
    # -- a hold that outlasts a slow rejection (the defaults: 30 s, then 60 s of silence, 300 s in all) --
    ("an overload 40 s after response.created, only keepalives before it: held on (Codex kept alive), moved",
     {"bootstrap_timeout": 30.0},
     [[Head(200, SSE, True), Chunk(HELLO), 10, Chunk(KEEPALIVE), 10, Chunk(KEEPALIVE), 10, Tick(), 5,
       Chunk(KEEPALIVE), 5, Chunk(OVERLOAD_EVENT)], stream(answer("b"))],
     ["try 1 a", "heartbeat 15", "record failover overloaded 200", "cancel", "try 2 b", f"commit {len(answer('b'))}b",
      "succeeded", "record commit output 200", "done"], {"a": "overloaded"}),
    ("an upstream silent past first_event_timeout in an extended hold moves (nothing cools)",
     {"bootstrap_timeout": 30.0},
     [[Head(200, SSE, True), Chunk(HELLO), 30, Tick(), 29, Tick(), 1, Tick()], stream(answer("b"))],  # silent since 0 s
     ["try 1 a", "heartbeat 15", "record failover stalled_before_output 200", "cancel", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),
    ("keepalives forever: committed at max_hold, as at the budget before", {"bootstrap_timeout": 30.0, "max_hold": 100.0},
     [[Head(200, SSE, True), Chunk(HELLO), *[x for _ in range(9) for x in (10, Chunk(KEEPALIVE))], 10, Tick()]],
     ["try 1 a", "heartbeat 15",
      f"commit {len(HELLO) + 9 * len(KEEPALIVE)}b", "succeeded", "record commit timeout 200", "done"], {}),
    ("closed before output moves", {}, [[Head(200, SSE, True), End()], stream(answer("b"))],
     ["try 1 a", "record failover closed_before_output 200", "cancel", "try 2 b",
      f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"], {}),  # (it never cooled)
]


@pytest.mark.parametrize("name,options,scripts,transcript,cooling", CASES, ids=[c[0] for c in CASES])
def test_request_machine(name, options, scripts, transcript, cooling):
    options = dict(options)
    world = World(creds=options.pop("_creds", ("a", "b")), **options)
    assert drive(world, scripts) == transcript
    assert world.cooling() == cooling


def test_all_cooling_dials_nothing():
    world = World()
    for name in ("a", "b"):
        world.health.cool(name, 600, "usage_limit")
    assert drive(world, []) == ["all cooling"]


def test_a_served_attempt_homes_the_session_and_ends_its_overload_streak():
    world = World(overload=OverloadPolicy(first=60.0, factor=2.0, max=600.0, max_held_out=1.0))
    world.health.streaks.overloaded("a", world.clock(), world.pool.policy.overload)
    drive(world, [stream(answer())])
    assert world.feedback.affinity.get("session-1") == "a"
    world.clock.now += 1
    drive(world, [stream(overloaded()), stream(answer("b"))])
    assert world.health.state("a").until - world.clock.now == pytest.approx(60.0)  # a first rest, not a second


def test_a_compact_answer_keeps_its_artifacts():
    world = World()
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "sealed"}
    body = json.dumps({"output": [item]}).encode()
    drive(world, [whole(200, body)], world.machine(compact=True))
    assert world.provenance.owner(item_keys(item)) == "a"


def test_a_committed_streams_live_rest_records_what_it_made():
    world = World()
    turn = Turn("a", 2)
    events = turn.handshake() + turn.answer()
    m = world.machine()
    step = m.next()
    assert isinstance(step, Try)
    assert m.attempt.send(Head(200, SSE, True)) == []
    held = 0
    while not m.attempt.over:  # held until the first output
        held += len(events[0])
        commands = m.attempt.send(Chunk(events.pop(0)))
    assert [show(c) for c in commands] == [f"commit {held}b", "succeeded", "record commit output 200"]
    m.attempt.live(b"".join(events))
    m.attempt.live(None)
    assert world.provenance.owner([RESPONSE + turn.rid]) == "a"
    assert world.provenance.owner(artifacts_of_output([{"type": "compaction", "id": "never"}])) is None
    assert isinstance(m.next(), Done)


def delta_then_overload() -> tuple[bytes, bytes]:
    """The start of an answer up to its first text delta, and an overload after it."""
    turn = Turn("a", 2)
    answer_events = turn.answer()
    first = next(i for i, e in enumerate(answer_events) if b"output_text.delta" in e)
    return (b"".join(turn.handshake() + answer_events[:first + 1]),
            turn.overload_error() + turn.failed("server_is_overloaded", "overloaded"))


def test_an_overload_after_output_ends_the_live_stream_and_cools_its_credential():
    """core/after_output.py: the committed stream's events go out whole until the overload; then it ends
    (nothing of the rejection goes out), the credential cools, and the re-send moves."""
    world = World()
    start, late = delta_then_overload()
    m = world.machine()
    assert isinstance(m.next(), Try)
    m.attempt.send(Head(200, SSE, True))
    commands = m.attempt.send(Chunk(start + late[:7]))  # (the read ends inside the overload's event)
    assert [show(c) for c in commands][0] == f"commit {len(start)}b"  # whole events only
    m.attempt.succeeded()
    released = m.attempt.live(late[7:])
    assert released.out == b"" and released.cut is not None and released.cut.reason == "overloaded"
    assert world.cooling() == {"a": "overloaded"} and m.attempt.late.reason == "overloaded"
    assert m.attempt.live(b"data: more\n\n").out == b""  # nothing after the cut
    assert isinstance(m.next(), Done)
    again = world.machine()
    step = again.next()
    assert isinstance(step, Try) and step.candidate.name == "b"


def test_a_cut_before_the_shell_carries_out_the_commits_success_keeps_the_credential_cooling():
    """The shell carries out a commit's commands after the client's first output (request_run: it waits
    for it), and the live rest runs meanwhile: under load the overload after the output came first.
    The success carried out after that must not restore the credential the cut cooled (seen in CI:
    Codex's re-send went back to it instead of moving)."""
    world = World()
    start, late = delta_then_overload()
    m = world.machine()
    assert isinstance(m.next(), Try)
    m.attempt.send(Head(200, SSE, True))
    m.attempt.send(Chunk(start))
    assert m.attempt.live(late).cut is not None
    m.attempt.succeeded()  # (carried out after the cut)
    assert world.cooling() == {"a": "overloaded"}
    again = world.machine()
    step = again.next()
    assert isinstance(step, Try) and step.candidate.name == "b"


def test_an_overload_in_the_same_read_as_the_first_output_fails_over_before_anything_went_out():
    world = World()
    start, late = delta_then_overload()
    assert drive(world, [stream(start + late), stream(answer("b"))]) == [
        "try 1 a", "record failover overloaded 200", "cancel",
        "try 2 b", f"commit {len(answer('b'))}b", "succeeded", "record commit output 200", "done"]
    assert world.cooling() == {"a": "overloaded"}


# -- recovery (docs/recovery.md) --------------------------------------------------------------------

RECOVERY = RecoveryPolicy(enabled=True, attempts=2, heartbeat=15.0, backoff_initial=0.25, backoff_max=0.25)


def test_recovery_buffers_the_whole_stream_then_commits():
    world = World(recovery=RECOVERY)
    assert drive(world, [stream(answer())]) == [
        "try 1 a", "heartbeat 15", f"commit {len(answer())}b ended", "succeeded", "record commit output 200", "done"]
    assert world.slots.used == 0


def test_recovery_retries_a_stream_that_failed_and_delivers_it_when_retries_run_out():
    world = World(recovery=RECOVERY)
    body = failed_in_stream()
    assert drive(world, [stream(body)] * 3) == [
        "try 1 a", "heartbeat 15", "record recover server_error 200", "wait 0.125",
        "try 1 a", "heartbeat 15", "record recover server_error 200", "wait 0.125",
        "try 1 a", "heartbeat 15", "record recover server_error 200",
        f"give up (server_error): commit {len(body)}b ended, succeeded, record commit output 200"]
    assert world.slots.used == 0


def test_recovery_on_a_stream_without_its_end_answers_with_recovery_exhausted():
    world = World(recovery=RecoveryPolicy(enabled=True, attempts=1, heartbeat=0.0, backoff_initial=0.25,
                                          backoff_max=0.25))
    body = b"".join(Turn("a", 1).handshake() + Turn("a", 1).answer()[:3])
    assert drive(world, [stream(body)] * 2) == [
        "try 1 a", "record recover no_terminal_event 200", "wait 0.125",
        "try 1 a", "record recover no_terminal_event 200", "give up (no_terminal_event): "]


def test_recovery_of_a_bare_503_retries_then_delivers_it_and_cools_nothing():
    """Settled: a final 5xx after recovery teaches the pool what any bare 5xx does (nothing: it is
    the way that failed, not the account; core/taxonomy.py). It cooled the credential before."""
    world = World(recovery=RecoveryPolicy(enabled=True, attempts=1, heartbeat=0.0, backoff_initial=0.25,
                                          backoff_max=0.25))
    assert drive(world, [whole(503, b"busy")] * 2) == [
        "try 1 a", "read whole", "record recover status_503 503", "wait 0.125",
        "try 1 a", "read whole", "record recover status_503 503", "give up (HTTP 503): respond"]
    assert world.cooling() == {}


def test_recovery_over_its_buffer_streams_the_rest_live():
    world = World(recovery=RecoveryPolicy(enabled=True, max_buffer_bytes=64 * 1024, heartbeat=0.0))
    turn = Turn("a", 2)
    head, big = b"".join(turn.handshake() + turn.answer()[:3]), b"data: " + b"x" * 70_000 + b"\n\n"
    assert drive(world, [[Head(200, SSE, True), Chunk(head), Chunk(big)]]) == [
        "try 1 a", f"commit {len(head) + len(big)}b", "succeeded", "record commit output 200", "done"]
    assert "recovery: response over 65536 bytes; streaming the rest live" in world.told


def test_recovery_with_no_data_for_response_timeout_retries():
    world = World(recovery=RecoveryPolicy(enabled=True, attempts=1, heartbeat=0.0, backoff_initial=0.25,
                                          backoff_max=0.25), response_timeout=30.0)
    head = b"".join(Turn("a", 2).handshake() + Turn("a", 2).answer()[:3])
    out = drive(world, [[Head(200, SSE, True), Chunk(head), 30, Tick()], stream(answer())])
    assert out == ["try 1 a", "record recover transport_error 200", "cancel", "wait 0.125", "try 1 a",
                   f"commit {len(answer())}b ended", "succeeded", "record commit output 200", "done"]


def test_recovery_with_every_slot_taken_streams_live():
    world = World(recovery=RecoveryPolicy(enabled=True, max_concurrent=1, heartbeat=0.0))
    world.slots.take(1)
    assert drive(world, [stream(answer())])[1] == f"commit {len(answer())}b"  # not kept whole


def test_the_client_gone_while_buffering_gives_its_slot_back():
    world = World(recovery=RECOVERY)
    head = b"".join(Turn("a", 2).handshake() + Turn("a", 2).answer()[:3])
    drive(world, [[Head(200, SSE, True), Chunk(head), "gone"]])
    assert world.slots.used == 0


# -- the client's own credential -------------------------------------------------------------------

def test_the_clients_own_401_is_its_answer_and_it_is_never_lent_the_pool():
    world = World(creds=("a",), use_client=True)
    out = drive(world, [whole(401, error_body({"message": "bad key"}))])
    assert out == ["try 1 client", "read whole", "respond", "succeeded", "record deliver auth_rejected 401", "done"]
    assert world.feedback.rejected_keys is None or CLIENT.fingerprint in world.feedback.rejected_keys


def test_a_pooled_credentials_401_takes_it_out():
    world = World()
    drive(world, [whole(401, error_body({"message": "bad key"})), stream(answer("b"))])
    assert world.health.state("a").status == "out"


# -- a WebSocket turn -------------------------------------------------------------------------------

def ws_rejection(reason: str = "overloaded", status: int | None = 503) -> Rejection:
    return Rejection(reason, status, {"message": reason})


S = TurnState
TURNS = [
    ("served", None, True, True, S.SERVED, {}),
    ("a self-contained turn moves (its loop picks the socket, waits included)", ws_rejection(), True, True, S.MOVING,
     {"a": "overloaded"}),
    ("a continued turn with another credential ready: reconnect", ws_rejection(), False, True, S.RECONNECTING,
     {"a": "overloaded"}),
    ("a continued overloaded turn and nobody else: the same socket after a backoff", ws_rejection(), False, False,
     S.RESENDING, {"a": "overloaded"}),
    ("a continued turn not worth retrying there, nobody else: reconnect (then HTTP answers)",
     ws_rejection("usage_limit", 429), False, False, S.RECONNECTING, {"a": "usage_limit"}),
    ("outside a turn: delivered", ws_rejection(), None, True, S.DELIVERED, {"a": "overloaded"}),
    ("a turn's usage limit cools until it resets", ws_rejection("usage_limit", 429), True, True, S.MOVING,
     {"a": "usage_limit"}),
    # The socket lost the turn's state (previous_response_not_found after a move): Codex reconnects and
    # re-sends it whole, even with nobody else ready; nothing cools.
    ("a turn whose socket lost its state reconnects", ws_rejection("state_lost", 400), False, False, S.RECONNECTING,
     {}),
    ("the edge's refusal moves a turn and cools nothing", ws_rejection("edge_blocked", 403), True, True, S.MOVING, {}),
]


def turn_machine(world: World) -> TurnMachine:
    return TurnMachine(world.pool.policy.cooldown_wait, world.health.now)


@pytest.mark.parametrize("name,rejection,movable,others,state,cooling", TURNS, ids=[t[0] for t in TURNS])
def test_websocket_turn(name, rejection, movable, others, state, cooling):
    world = World()
    cand = make_plan(CLIENT, world.pool, world.health, True).candidates[0]
    assert turn_machine(world).settle(world.scope(), cand, rejection, [], movable, lambda: others) is state
    assert world.cooling() == cooling


def test_a_turn_refused_on_the_clients_own_key_is_its_answer_and_takes_nothing_out():
    """Settled: the gate took the client's own key out of rotation on an in-stream 401; the HTTP
    path never did (`cools`). Now both deliver it and only mark the key as not to be lent the pool."""
    world = World(creds=("a",), use_client=True)
    own = make_plan(CLIENT, world.pool, world.health, True).candidates[0]
    assert own.is_client
    state = turn_machine(world).settle(world.scope(), own, ws_rejection("auth_rejected", 401), [], True, lambda: True)
    assert state is S.DELIVERED
    assert world.health.state(own.key).status == "ready"


def test_a_continued_turn_on_the_only_credential_backs_off_as_http_then_reconnects():
    """The same socket after 0.5 s, 1 s, 2 s (HTTP's backoff on its only credential, bounded by
    cooldown_wait), then a close Codex retries, never the overload itself."""
    world = World(creds=("a",))
    cand = make_plan(CLIENT, world.pool, world.health, True).candidates[0]
    m, seen = turn_machine(world), []
    for _ in range(4):
        state = m.settle(world.scope(), cand, ws_rejection(), [], False, lambda: False)
        seen.append((state.value, m.delay if state is S.RESENDING else None))
        if state is S.RESENDING:
            world.clock.now += m.delay
            assert m.fire(TurnEvent.RESENT) is S.HELD
    assert seen == [("resending", 0.5), ("resending", 1.0), ("resending", 2.0), ("reconnecting", None)]
    m.new_turn()
    assert (m.state, m.sends) == (S.HELD, 1)


def test_an_upstream_retry_after_longer_than_cooldown_wait_reconnects_at_once():
    world = World(creds=("a",))
    cand = make_plan(CLIENT, world.pool, world.health, True).candidates[0]
    slow = Rejection("overloaded", 503, {"message": "busy"}, retry_after="30")
    assert turn_machine(world).settle(world.scope(), cand, slow, [], False, lambda: False) is S.RECONNECTING


@pytest.mark.parametrize("start,event,end", [
    (S.MOVING, TurnEvent.OPENED, S.HELD),
    (S.MOVING, TurnEvent.NONE_OPENED, S.RECONNECTING),
    (S.RESENDING, TurnEvent.RESENT, S.HELD),
    (S.RESENDING, TurnEvent.SOCKET_GONE, S.RECONNECTING),
    (S.SERVED, TurnEvent.AFTER_OUTPUT, S.RECONNECTING),
])
def test_turn_transitions_after_a_rejection(start, event, end):
    m = TurnMachine(2.0, lambda: 0.0, state=start)
    assert m.fire(event) is end


def test_no_rejection_a_turn_could_still_serve_ends_in_delivery():
    """Only the client's own refusal, a rejection outside any turn, and a model nobody was seen serving
    (refused by enough accounts: the service's answer) reach Codex as they are."""
    assert {e for (_, e), end in TRANSITIONS.items() if end is S.DELIVERED} == {
        TurnEvent.OWN_REFUSAL, TurnEvent.NO_TURN, TurnEvent.NO_SUCH_MODEL}  # (that one: the service's own answer)
    with pytest.raises(ValueError):
        TurnMachine(2.0, lambda: 0.0, state=S.SERVED).fire(TurnEvent.OPENED)


def test_a_rejection_after_output_cools_and_reconnects():
    """An overload after a few deltas on the gated socket: the credential cools (the re-send moves)
    and the turn ends in a close Codex retries."""
    world = World()
    cand = make_plan(CLIENT, world.pool, world.health, True).candidates[0]
    m = turn_machine(world)
    assert m.settle(world.scope(), cand, None, [], True, lambda: True) is S.SERVED
    assert m.settle(world.scope(), cand, ws_rejection(), [], True, lambda: True, after_output=True) is S.RECONNECTING
    assert world.cooling() == {"a": "overloaded"}


def test_close_codes():
    assert client_close_after_upstream(None) == 1011 and client_close_after_upstream(1006) == 1011
    assert client_close_after_upstream(1000) == 1000 and client_close_after_upstream(4000) == 4000
    assert upstream_close_after_client(None) == 1000 and upstream_close_after_client(1001) == 1001
    assert client_close_at_end(True) == 1011 and client_close_at_end(False) == 1000


def test_a_turn_that_cannot_go_home_is_answered_as_http_answers_a_pinned_request():
    answer = cannot_go_home("carries a compaction item")
    assert (answer.reason, answer.status, answer.error["code"]) == ("no_usable_credential", 503, "no_usable_credential")
    assert "compaction item" in answer.error["message"]


def test_recovery_exhausted_on_a_408_cools_nothing():
    world = World(recovery=RecoveryPolicy(enabled=True, attempts=1, heartbeat=0.0, backoff_initial=0.25,
                                          backoff_max=0.25))
    out = drive(world, [whole(408, b"")] * 2)
    assert out[-1] == "give up (HTTP 408): respond"
    assert world.cooling() == {}


def test_recovery_exhausted_on_a_503_the_rules_class_as_an_overload_cools_as_one():
    """The same answer teaches the pool the same thing with recovery on as off: a JSON 503 that
    names no rejection is an overload by its status (rules/default.yaml)."""
    world = World(recovery=RecoveryPolicy(enabled=True, attempts=1, heartbeat=0.0, backoff_initial=0.25,
                                          backoff_max=0.25))
    body = error_body({"type": "server_error", "message": "Service Unavailable"})
    assert drive(world, [whole(503, body)] * 2)[-1] == "give up (HTTP 503): respond"
    without = World()
    drive(without, [whole(503, body), stream(answer("b"))])
    assert world.cooling() == {"a": without.cooling()["a"]}


def test_a_stream_that_ends_empty_just_past_the_window_still_moves():
    world = World(bootstrap_timeout=2.0)
    out = drive(world, [[Head(200, SSE, True), Chunk(HELLO), 3, End()], stream(answer("b"))])
    assert out[:3] == ["try 1 a", "record failover closed_before_output 200", "cancel"]


def test_the_head_deadlines_run_from_the_attempts_start():
    world = World(connect_timeout=5.0)
    m = world.machine()
    assert isinstance(m.next(), Try)
    world.clock.now += 10  # building the attempt's way took long
    m.attempt.start()
    assert m.attempt.deadline == world.clock.now + 5.0


def test_abandon_gives_a_recovery_slot_back():
    world = World(recovery=RECOVERY)
    m = world.machine()
    m.next()
    m.attempt.send(Head(200, SSE, True))
    m.attempt.send(Chunk(b"".join(Turn("a", 2).handshake() + Turn("a", 2).answer()[:3])))
    assert world.slots.used == 1
    m.attempt.abandon()
    m.attempt.abandon()
    assert world.slots.used == 0


@pytest.mark.parametrize("stays_home,home,current,goes", [
    (True, "work", "client", True),  # bound to work, on the client's socket: a socket on work first
    (True, "work", "work", False),  # already home
    (False, "work", "client", False),  # not bound: sent where it is
])
def test_a_bound_turn_goes_home_first(stays_home, home, current, goes):
    assert goes_home(stays_home, home, current) is goes


def test_an_exhausted_turn_is_answered_with_its_own_rejection_while_its_socket_is_open():
    own, dial = ws_rejection("overloaded", 503), ws_rejection("usage_limit", 429)
    assert exhausted_answer(own, True, dial) is own
    assert exhausted_answer(own, False, dial) is dial  # the socket closed: the last failed upgrade's
    assert exhausted_answer(own, False, None) is own


def test_a_session_whose_socket_closed_exhausted_goes_over_http_at_its_next_upgrade():
    """core/turn_machine.Reconnects: once, within its window, bounded."""
    from codex_failover.core.turn_machine import Reconnects

    clock = Clock()
    book = Reconnects(clock, window=60.0, limit=2)
    assert book.downgrade("s1") is False  # nothing closed: gated
    book.closed_exhausted("s1")
    clock.now += 59
    assert book.downgrade("s1") is True  # its reconnect: 426, Codex re-sends over HTTP
    assert book.downgrade("s1") is False  # once: the session's next upgrade is gated again
    book.closed_exhausted("s1")
    clock.now += 61
    assert book.downgrade("s1") is False  # long ago: gated
    for session in ("a", "b", "c"):
        book.closed_exhausted(session)
    assert book.downgrade("a") is False and book.downgrade("c") is True  # the oldest forgotten past the limit
    book.closed_exhausted(None)
    assert book.downgrade(None) is False  # no session known: nothing to remember


def test_a_finished_attempt_machine_is_freed_by_reference_counting():
    """The machine's stream view reports what it saw (rate-limit windows) by value, not by calling back
    into the machine: no cycle, so a finished request (its machine, its run, its held stream and what
    they hold) is freed when the last reference goes, not at the collector's next pass."""
    import gc
    import weakref

    world = World()
    turn = Turn("a", 2)
    events = turn.handshake() + turn.answer()
    m = world.machine()
    assert isinstance(m.next(), Try)
    attempt = weakref.ref(m.attempt)
    m.attempt.send(Head(200, SSE, True))
    while not m.attempt.over:
        m.attempt.send(Chunk(events.pop(0)))
    m.attempt.live(b"".join(events))
    m.attempt.live(None)
    assert isinstance(m.next(), Done)
    gc.disable()  # no collection may free it
    try:
        del m
        assert attempt() is None, "the attempt machine sits in a reference cycle"
    finally:
        gc.enable()


def test_a_rate_limit_event_held_before_the_output_reaches_the_pool():
    """The stream view reports the windows of a `codex.rate_limits` event it framed; the machine hands
    them to the pool."""
    from conftest import WIRE

    world = World()
    payload = json.loads((WIRE / "ws" / "server_codex_rate_limits.json").read_text())
    limits = f"event: codex.rate_limits\ndata: {json.dumps(payload)}\n\n".encode()
    turn = Turn("a", 2)
    events = [limits] + turn.handshake() + turn.answer()
    m = world.machine()
    assert isinstance(m.next(), Try)
    m.attempt.send(Head(200, SSE, True))
    while not m.attempt.over:
        m.attempt.send(Chunk(events.pop(0)))
    assert world.feedback.usage.windows("a"), "the event's windows reached the pool"
