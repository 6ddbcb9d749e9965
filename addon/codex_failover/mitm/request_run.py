"""The held request's driver: run the attempts the failover loop asks for, and answer the client.

Every decision comes from the pure core (failover_loop: which attempt is next, when to wait, when to
stop; planner, classifier, taxonomy, health). This module does the I/O around them: it starts each
attempt (attempt.py, over a warm connection), reads its response head, hands a stream to the SSE
hold (core/attempt_machine.py), and answers the held client (held_client.py). The attempts come from an injected
engine (`Shared.engine`), so the driver runs in-process against a scripted one in tests.
docs/architecture.md, "The path of a model request".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback

from mitmproxy import http

from ..core import story
from ..core.activity import SSE, session_tag
from ..core.affinity import affinity_key, session_of
from ..core.attempt_events import (
    Broke,
    Cancel,
    Chunk,
    Command,
    Commit,
    End,
    Event,
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
from ..core.attempt_machine import BUFFER, AttemptMachine
from ..core.auth import AuthMaterial, auth_from_headers
from ..core.codex_request import is_compact, model_of
from ..core.failover_loop import FailoverLoop
from ..core.outcomes import AllCooling, Exhausted, Final, Rejected, Rejection, RouteDown, Try, Wait
from ..core.planner import Candidate, Plan, make_plan
from ..core.pool_reach import kind_gap, unreachable
from ..core.replay_safety import MovePolicy, assess
from ..core.request_machine import Done, GiveUp, RequestMachine
from ..core.routes import Endpoint
from ..core.run_log import RunLog
from ..core.story import Skipped
from ..core.vocabulary import AS_IT_CAME, CLIENT_GONE, Verdict
from ..shared import Shared
from . import bounded_body, client_answers, secret_guard
from .attempt import CHUNK, END, ERROR, Attempt, Item, copy_request, hide_secrets
from .attempt_maker import AttemptMaker
from .direct import DirectAttempt
from .held_client import HeldClient, shown_changed
from .held_stream import HeldStream

log = logging.getLogger("codex_failover")

POLL = 0.25  # how often a held request checks that its client is still there
CLIENT_ERRORS = ("stream reset by client", "Client disconnected", "client disconnected")  # mitmproxy's words


class ClientGone(Exception):
    pass


class RequestRun:
    """One held model request, from the start of the hold to its answer."""

    def __init__(self, flow: http.HTTPFlow, shared: Shared, body, request_id: str, rotation: int = 0,
                 client_auth: AuthMaterial | None = None):
        self.flow, self.shared, self.body, self.request_id = flow, shared, body, request_id
        self.pool, self.rules, self.health = shared.pool, shared.rules, shared.health  # kept for the whole request
        self.rotation = rotation  # this request's turn in round-robin selection
        self.task: asyncio.Task | None = None  # this run (the relay's hop cancels it if the client leaves)
        self.client = HeldClient(flow, shared.relay, self._abort, shared.metrics)
        self.log = RunLog(request_id, flow, shared.metrics, shown_changed)
        self.original: http.Request | None = None  # the request as the client sent it (attempts copy it)
        self.move = MovePolicy(True)
        self.model: str | None = None  # the request's model (a credential may lack it)
        self.session: str | None = None  # the client's key and its Codex session (thread) id: affinity's key
        self.winner: Attempt | None = None  # the committed attempt, streaming through the relay
        self.current: Attempt | None = None  # the attempt in flight, or the last one
        self.whole: bounded_body.Outcome | None = None  # its whole answer, once read
        # Whole answers the client may get as they came should nothing serve (vocabulary.AS_IT_CAME):
        # (rejection, response, body, the client's own credential's); a few per request, each bounded.
        self.kept: list[tuple[Rejection, http.Response, object, bool]] = []
        self.last_plan: Plan | None = None  # for pre-warming the next candidate's connection
        self.dispatched = asyncio.Event()  # the first attempt's head was written, or the run ended
        self.client_auth = client_auth  # the client's own credential (read from its request when not given)

    def hold(self) -> http.Request:
        """Give the client flow its hop now, before any attempt (docs/architecture.md#the-held-stream): its request, as it came."""
        self.original = copy_request(self.flow.request)  # the flow shows no secret from here on
        self.client.hold()
        return self.original

    async def run(self) -> None:
        req = self.original if self.original is not None else self.hold()
        hide_secrets(self.flow.request)
        self.move = assess(self.body, req.headers, self.pool.policy.encrypted_reasoning, self.shared.provenance.owner)
        self.log.why_pinned = self.move.why_pinned
        if not self.move.movable:
            log.info("[%s] %s: %s", self.request_id, story.bound_to(self.move.bound_to, self.pool), self.move.why_pinned)
            self.log.tell()
        if self.client_auth is None:
            self.client_auth = auth_from_headers(req.headers)
        self.log.client_auth = self.client_auth
        self.session = affinity_key(self.client_auth.account if self.client_auth else None,
                                    session_of(req.headers, self.body))
        self.model = model_of(self.body)
        self.log.session = session_tag(self.session)
        if self.shared.activity is not None:
            self.log.activity = self.shared.activity
            self.log.entry = self.shared.activity.start(self.request_id, time.time(), self.session, self.model, SSE)
        self.maker = AttemptMaker(self.request_id, self.flow, self.client, req, self.body, self.move, shared=self.shared,
                                  pool=self.pool)
        self.body = None  # the maker has it (for a moved copy), and lets it go once built
        loop = FailoverLoop(self._plan, self.health, self.shared.route_health, self.pool, tell=self._tell,
                            model=self.model)
        self.log.total = loop.total
        shared = self.shared
        context = Scope(self.rules, self.pool, shared.feedback, shared.provenance, shared.recovery_slots,
                          time.monotonic, is_compact(req.path), self.session, self.client_auth,
                          f"[{self.request_id}] ", self._tell, self.model)
        try:
            await self._follow(RequestMachine(loop, context))
        except BaseException:
            loop.abandon()  # an attempt the client left (or a bug) must not keep its endpoint claimed
            raise
        finally:  # the run sits in cycles a full collection breaks tens of requests later: its body goes now
            self.maker.let_go()

    async def _follow(self, machine: RequestMachine) -> None:
        while True:
            self._check_client()  # before each step: a client gone meanwhile gets no further attempt
            match machine.next():
                case Try(cand, ep, n):
                    await self._send(machine, cand, n, ep)
                case Wait(seconds, _):
                    await self._sleep_holding(seconds)  # a client that leaves stops everything here
                case Done():
                    return
                case RouteDown(cand, rejection):
                    log.warning("[%s] credential %s: %s (the credential is not penalised)", self.request_id,
                                cand.name, rejection.error["message"])
                case GiveUp(commands, why):
                    if not commands:
                        return self.client.respond(client_answers.recovery_exhausted(why, self.log.history))
                    return await self._carry_out(machine.attempt, commands)
                case Final(rejection):
                    return self._answer(client_answers.upstream_failed(rejection.error.get("message") or rejection.reason,
                                                                       self.log.history), "upstream failed")
                case Exhausted(last, retry_after, first, as_it_came) if (kept := kept_answer(self.kept, as_it_came)):
                    return self._answer(kept, "exhausted", "; the upstream's answer as it came")
                case Exhausted(last, retry_after, first):
                    answer = client_answers.exhausted(last, self.log.history, retry_after, self.move.why_pinned, first)
                    gap = kind_gap(self.client_auth, self.pool) if self.move.movable else None
                    return self._answer(answer, "exhausted", f"; no other credential could serve it: {gap}" if gap else "")
                case AllCooling(states, _) if not states and (missing := unreachable(self.client_auth, self.pool,
                                                                                     self.move.movable)):
                    return self._answer(client_answers.no_pool_credential(missing), "no pool credential for it",
                                        " (not dialled)")
                case AllCooling(states, retry_after, first):
                    answer = client_answers.all_cooling(list(states), retry_after, self.move.why_pinned, first)
                    return self._answer(answer, story.nobody_to_serve(states, self.move.movable), " (not dialled)")

    def _tell(self, level: int, text: str) -> None:
        """A line the failover loop logs about this request."""
        log.log(level, "[%s] %s", self.request_id, text)

    def _plan(self) -> Plan:
        shared = self.shared
        sticky = shared.affinity.get(self.session) or self.move.prefers
        plan = make_plan(self.client_auth, self.pool, self.health, self.move.movable, sticky, self.rotation,
                         self.move.bound_to, self.model)
        first, self.last_plan = self.last_plan is None, plan
        if first and plan.skipped and plan.candidates:  # (with nothing to try, the answer says it)
            log.info("[%s] not tried: %s session=%s", self.request_id, "; ".join(
                story.skipped_line(c.name, why, self.health.state(c.key), self.health.now()) for c, why in plan.skipped),
                self.log.session)
        for cand, why in plan.skipped:
            state = self.health.state(cand.key)
            self.log.skipped[cand.name] = Skipped(cand.name, why, state.until, state.reason)
            if why == "expired":
                _expired_once(shared.notices, cand)
        return plan

    # -- one attempt: bytes in, the machine's commands out ------------------------------------

    async def _send(self, machine: RequestMachine, cand: Candidate, n: int, ep: Endpoint | None) -> None:
        """Attempt `n`: the request on `cand`'s credential through `ep` (None: direct), fed to its
        machine until it is over (committed, answered, rejected or worth retrying)."""
        attempt = self.maker.make(cand, n, ep)
        if not attempt.direct and isinstance(self.client.hop, HeldStream):
            self.client.hop.decide(False)  # the stream takes its stand-in (it answers)
        attempt.on_sent = self.dispatched.set
        attempt.endpoint = ep
        self.shared.attempts[attempt.flow.id] = attempt
        if isinstance(attempt, DirectAttempt):  # a served one has no final hook to take it out (direct.py)
            attempt.registry = self.shared.attempts
        self.current, self.whole, self.recorded = attempt, None, False
        state = machine.attempt
        assert state is not None
        try:
            via = await self.maker.via(ep)
            self._check_client()  # before the dial
            attempt.start(via)
            state.start()
            self.maker.prewarm_next(self.last_plan, cand)
            while not state.over:
                await self._carry_out(state, state.send(await self._event(state, attempt)))
            result = state.result
            if isinstance(result, Rejected) and result.rejection.reason in AS_IT_CAME and self.whole is not None:
                self.kept.append((result.rejection, attempt.flow.response, self.whole, cand.is_client))
        except (ClientGone, asyncio.CancelledError):  # the run saw it, or the relay's hop closed
            gone = machine.client_gone()
            if not gone and not self.recorded:  # committed, the client left before its first output
                gone = [Record(Verdict.CANCELLED, CLIENT_GONE, None), Cancel()]
            await self._carry_out(state, gone)
            raise
        except BaseException:
            state.abandon()
            await attempt.cancel()
            raise

    async def _event(self, state: AttemptMachine, attempt: Attempt) -> Event:
        item = await self.next_item(attempt, state.deadline)
        if item is None:
            return Tick(attempt.connected)
        if item.kind == CHUNK:
            return Chunk(item.data)
        if item.kind == END:
            return End()
        if item.kind == ERROR:
            return Broke(item.data.decode(errors="replace"))
        return _head(attempt)

    async def _carry_out(self, state: AttemptMachine | None, commands: list[Command] | tuple[Command, ...]) -> None:
        attempt = self.current
        assert state is not None and attempt is not None
        cand = state.cand
        for command in commands:
            match command:
                case Record(verdict, reason, status, ok):
                    self.recorded = True
                    self.log.record(attempt, cand, verdict, reason, status, ok=ok)
                case Succeeded():
                    state.succeeded()
                case Cancel():
                    await attempt.cancel()
                case ReadWhole():
                    item = await self.next_item(attempt, state.deadline)
                    content = None
                    if item is not None and item.kind == END:
                        resp = attempt.flow.response  # never get_content(): decoded within its bound
                        assert resp is not None  # (its end came)
                        self.whole = await bounded_body.answer(resp, f"[{self.request_id}] credential {cand.name}")
                        content = self.whole.content or b""
                    await self._carry_out(state, state.send(Whole(content)))
                case Respond():
                    assert self.whole is not None
                    self.client.respond(secret_guard.forwarded(attempt.flow.response, self.whole, cand.is_client))
                case Heartbeat(seconds):
                    if self.client.sink is None:
                        self.client.start_heartbeat(seconds)
                        why = "the response is buffered" if state.phase == BUFFER else \
                            "nothing is shown yet past bootstrap_timeout: a late rejection may still come"
                        log.info("[%s] heartbeat every %gs while %s", self.request_id, seconds, why)
                case Commit() as commit:
                    self.winner = attempt
                    if self.log.entry is not None:
                        self.log.entry.tokens_from = lambda made=state.view.made: made.tokens
                    self.client.commit(attempt, state, commit, functools.partial(self._cut, attempt, state))
                    self.maker.let_go()  # no attempt follows a commit: the parsed body is not needed again
                    if commit.first:
                        await self.client.first_output()  # the client's first output before the bookkeeping
                        self.log.first_output()

    def _cut(self, attempt: Attempt, state: AttemptMachine) -> None:
        """The committed stream ended at a rejection after its output began (core/after_output.py)."""
        late = state.late
        if late is not None:
            self.log.cut(attempt, state.cand, late.reason, late.status)

    # -- answers ------------------------------------------------------------------------------

    def _answer(self, answer: http.Response, what: str, note: str = "") -> None:
        if self.shared.metrics is not None:
            self.shared.metrics.exhausted(answer.status_code)
        self.client.respond(answer)
        self.log.summary(f"{what} -> {answer.status_code}{note}")

    def _abort(self):
        """The relay's reader left (or the hop ended): stop the run, and a committed stream's attempt."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.winner is not None:
            return self.winner.cancel()
        return None

    # -- waiting while the client is held --------------------------------------------------

    async def next_item(self, attempt: Attempt, deadline: float | None) -> Item | None:
        """The attempt's next item; None at `deadline`; ClientGone if the client left."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            item = await attempt.next(POLL if left is None else min(POLL, left))
            if item is not None and item.kind != ERROR:
                return item
            self._check_client()  # (a broken attempt may be the client's reset reaching its upstream)
            if item is not None:
                return item

    async def _sleep_holding(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL, left))
            self._check_client()

    def _check_client(self) -> None:
        if client_left(self.flow, self.client.hop, self.winner is not None):
            raise ClientGone()

def client_left(flow: http.HTTPFlow, hop, committed: bool) -> bool:
    """Has the client left: closed (or half-closed) its connection, reset its HTTP/2 stream (h2's state,
    or the stream's error once mitmproxy handed it on)? The run asks before every dial and at every
    step, so a stream reset at once (rapid reset) costs no upstream work."""
    if not flow.client_conn.connected:
        return True
    return not committed and ((flow.error is not None and flow.error.msg.startswith(CLIENT_ERRORS))
                              or (isinstance(hop, HeldStream) and hop.stream_reset()))


def _head(attempt: Attempt) -> Head:
    """The head of an attempt's answer, as the attempt machine takes it (its head item came)."""
    response = attempt.flow.response
    assert response is not None
    return Head(response.status_code, response.headers, attempt.streaming)


def _expired_once(notices: set, cand: Candidate) -> None:
    """One warning per expired token (the plan skips it at every request until it is refreshed)."""
    assert cand.auth is not None  # (a credential's token expired)
    if (cand.name, cand.auth.expires_at) not in notices:
        notices.add((cand.name, cand.auth.expires_at))
        log.warning("credential %s: its ChatGPT access token expired at %s; it is skipped until refreshed. "
                    "Refresh it with `codex login` for that account (CODEX_HOME set to the folder of its "
                    "auth.json); codex-failover never refreshes tokens itself.", cand.name,
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cand.auth.expires_at)))


def start_run(run: RequestRun, on_done) -> asyncio.Task:
    """Give the held client its hop and run the request in the background; `on_done(run)`
    once it ended. Whatever happens, the client gets an answer or its hop closes: never a hang."""
    run.hold()
    run.task = asyncio.get_running_loop().create_task(_guarded(run))

    def ended(_task) -> None:
        try:
            run.dispatched.set()
            if isinstance(run.current, DirectAttempt):  # a verdict, if it had none (a bug): its record is shown
                run.current.unjudged()  # (direct.py waits on no timer; other attempts' hooks have one)
            if not run.client.answered:  # the client left, or a bug: the relay hop must end too
                run.client.internal_error("the request ended without an answer")
        finally:
            on_done(run)  # the held count and the task set, whatever happened above

    run.task.add_done_callback(ended)
    return run.task


async def _guarded(run: RequestRun) -> str | None:
    """Run one request; a bug must fail with a clear status, never hang the client."""
    try:
        await run.run()
    except (ClientGone, asyncio.CancelledError):  # seen by the run, or the relay's hop closed
        log.info("[%s] client went away while held; attempts cancelled", run.request_id)
        return CLIENT_GONE
    except Exception as exc:  # noqa: BLE001
        log.error("[%s] codex-failover internal error: %s\n%s", run.request_id, exc, traceback.format_exc())
        run.client.internal_error(type(exc).__name__)
        return type(exc).__name__
    return None


def kept_answer(kept: list[tuple[Rejection, http.Response, object, bool]], rejection: Rejection | None) -> http.Response | None:
    """The upstream's own answer that gave `rejection` (a whole one, kept by `RequestRun._send`), as the
    client gets it (secret_guard.forwarded); None when there is none."""
    for which, response, whole, own in kept:
        if which is rejection:
            return secret_guard.forwarded(response, whole, own)
    return None
