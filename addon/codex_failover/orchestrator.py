"""One held Codex model request: run the attempts the failover loop asks for, commit the winner or
answer the client.

Every decision comes from the pure core (failover_loop for which attempt is next, when to wait and
when to stop; planner, classifier, taxonomy, health); this module wires them to attempts, the relay
and the flow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from mitmproxy import ctx, http
from mitmproxy.hooks import UpdateHook
from mitmproxy.connection import ConnectionState, Server

from . import client_answers, seen_clients, story
from .affinity import Affinity, session_of
from .attempt import CHUNK, END, ERROR, Attempt, Item, hide_secrets
from .auth import AuthMaterial, auth_from_headers
from .classifier import FRAMING_ERROR, BootstrapClassifier, Decision, Verdict
from .codex_request import swap_credential
from .config import PoolConfig
from .failover_loop import (SERVED, AllCooling, Exhausted, FailoverLoop, Final, RecoveryExhausted, Rejected,
                            Rejection, RouteDown, Transient, Try, Wait, cools, own_refusal)
from .framer import FramerError, SSEFramer
from .health import Health
from .heartbeat import HEADERS, HeartbeatSink
from .outcomes import Outcomes
from .planner import Candidate, Plan, make_plan
from .recovery import (NO_TERMINAL, RECOVERABLE_STATUS, TRANSPORT, Slots, TerminalTracker,
                       recoverable_stream_end)
from .relay import Relay, RelaySession, UpstreamBroken
from .metrics import Metrics
from .replay_safety import PIN_HEADER, MovePolicy, assess, strip_encrypted_reasoning
from .routes import Endpoint, RouteHealth
from .rules import Rules
from .socks_bridge import SocksBridges
from .taxonomy import FAILOVER, UPSTREAM_5XX, classify_response
from .transport import (HOST_NETWORK, INCOMPLETE_RESPONSE, PRE_DISPATCH, RESPONSE_TIMEOUT, TLS_FAILED,
                        classify_connection_error)
from .usage import UsageBook, Window, from_event, from_headers
from .warm_conn import WarmConnections, WarmKey

log = logging.getLogger("codex_failover")

RELAY_TAG = "codex_failover.relay"
POLL = 0.25  # how often a held request checks that its client is still there


class ClientGone(Exception):
    pass


def shown_changed(flow: http.HTTPFlow) -> None:
    """Tell mitmweb (its view addon) that a live flow's comment or mark changed between hooks."""
    try:
        ctx.master.addons.trigger(UpdateHook([flow]))
    except AttributeError:  # no master (unit tests without taddons)
        pass


def point_at_relay(flow: http.HTTPFlow, port: int, token: str) -> None:
    """Send the client's flow to the loopback relay; the real request is shown again later."""
    shown = flow.request.copy()
    hide_secrets(shown)
    # Restored for display once the response ends; kept as plain data so the flow can be saved.
    flow.metadata[RELAY_TAG] = shown.get_state()
    req = flow.request
    req.scheme, req.host, req.port = "http", "127.0.0.1", port
    req.path = f"/r/{token}"
    for name in ("authorization", "cookie", "chatgpt-account-id"):
        req.headers.pop(name, None)
    flow.server_conn = Server(address=("127.0.0.1", port))


@dataclass
class AttemptLog:
    n: int
    credential: str
    verdict: str
    reason: str
    elapsed_ms: int
    status: int | None = None

    route: str = "direct"

    def as_dict(self) -> dict:
        return {"attempt": self.n, "credential": self.credential, "route": self.route,
                "verdict": self.verdict, "reason": self.reason, "status": self.status}


@dataclass
class Outcome:
    """How one attempt ended, in the attempt's words; `result()` is what the failover loop is told."""

    kind: str  # "committed", "answered", "rejected" (the loop decides if it moves), "recover" (retry the same)
    rejection: Rejection | None = None
    message: str = ""
    final: object = None  # for "recover": how to answer if no retry is left (see _give_up)

    def result(self):
        if self.kind == "rejected":
            return Rejected(self.rejection)
        if self.kind == "recover":
            return Transient(self.message, self.final)
        return SERVED


@dataclass
class RequestRun:
    flow: http.HTTPFlow
    pool: PoolConfig
    rules: Rules
    health: Health
    relay: Relay
    registry: dict  # attempt flow id -> Attempt, so the addon's hooks can find attempts
    affinity: Affinity = field(default_factory=Affinity)
    rotation: int = 0  # this request's turn in round-robin selection
    notices: set = field(default_factory=set)  # one-time warnings already logged (shared by the addon)
    usage: UsageBook = field(default_factory=UsageBook)
    route_health: RouteHealth = field(default_factory=RouteHealth)
    bridges: SocksBridges = field(default_factory=SocksBridges)
    recovery_slots: Slots = field(default_factory=Slots)
    request_id: str = ""
    history: list[AttemptLog] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    total: int = 0  # attempts planned for this request (for "attempt n/N")
    move: MovePolicy = MovePolicy(True)
    body: object = None  # the parsed request body (the addon parsed it to recognise the request)
    session: str | None = None  # the Codex session (thread) id, for affinity
    sink: HeartbeatSink | None = None  # heartbeat mode: the client already has its headers
    decided: asyncio.Event = field(default_factory=asyncio.Event)  # the client flow's answer is set
    task: asyncio.Task | None = None  # this run, when it outlives the request hook (heartbeat mode)
    original: http.Request | None = None  # the request as the client sent it (the flow's may point at the relay)
    client_auth: AuthMaterial | None = None  # the client's own credential, from `original`
    skipped: dict = field(default_factory=dict)  # credential name -> story.Skipped, for the flow comment
    moved_body: bytes | None = None  # see _moved_body
    hop: RelaySession | None = None  # the client's hop to the relay, from the start of the hold
    winner: Attempt | None = None  # the committed attempt, streaming through the relay
    last_plan: Plan | None = None  # for pre-warming the next candidate's connection
    metrics: Metrics | None = None  # Prometheus counters (failover_metrics), if on
    warm: WarmConnections | None = None  # the attempt engine: kept upstream connections (the addon's)

    def hold_at_relay(self) -> None:
        """Point the client flow at the relay now, before any attempt: mitmproxy connects to it and
        forwards the request while the attempts run, so committing is one write, and a client that
        leaves during the hold is noticed at once (docs/architecture.md#the-relay)."""
        self.original = self.flow.request.copy()  # attempts copy this; the flow shows no secret
        self.hop = RelaySession.held(self._abort)
        point_at_relay(self.flow, self.relay.port, self.relay.register(self.hop))

    async def run(self) -> None:
        if self.original is None:
            self.hold_at_relay()
        req = self.original
        hide_secrets(self.flow.request)
        self.move = assess(self.body, req.headers, self.pool.policy.encrypted_reasoning)
        if not self.move.movable:
            log.info("[%s] stays on its own credential: %s", self.request_id, self.move.why_pinned)
            self._tell_story()
        self.client_auth = auth_from_headers(req.headers)
        self.session = session_of(req.headers, self.body)
        loop = FailoverLoop(self._plan, self.health, self.route_health, self.pool, tell=self._tell)
        self.total = loop.total
        try:
            while True:
                match loop.next():
                    case Try(cand, ep, n):
                        outcome = await self._send(cand, n, ep)
                        loop.report(outcome.result())
                        if outcome.kind in ("committed", "answered"):
                            return
                    case Wait(seconds, _):
                        await self._sleep_holding(seconds)  # a client that leaves stops everything here
                    case RouteDown(cand, rejection):
                        log.warning("[%s] credential %s: %s (the credential is not penalised)", self.request_id,
                                    cand.name, rejection.error["message"])
                    case RecoveryExhausted() as step:
                        return self._give_up(step)
                    case Final(rejection):
                        return self._answer_broken(rejection.error.get("message") or rejection.reason)
                    case Exhausted(last, retry_after):
                        return self._answer_exhausted(last, retry_after)
                    case AllCooling(states, retry_after):
                        return self._answer_from_cooldown(states, retry_after)
        except BaseException:
            loop.abandon()  # an attempt the client left (or a bug) must not keep its endpoint claimed
            raise

    def _tell(self, level: int, text: str) -> None:
        """A line the failover loop logs about this request."""
        log.log(level, "[%s] %s", self.request_id, text)

    def _moved_body(self) -> bytes:
        """The body a moved attempt sends (encrypted reasoning stripped): built once per request,
        after which the parsed body is let go (it is the largest thing a request holds)."""
        if self.moved_body is None:
            stripped = strip_encrypted_reasoning(self.body)
            self.moved_body = json.dumps(stripped, separators=(",", ":"), ensure_ascii=False).encode()
            self.body = stripped = None
        return self.moved_body

    def _plan(self) -> Plan:
        sticky = self.affinity.get(self.session)
        plan = make_plan(self.client_auth, self.pool, self.health, self.move.movable, sticky, self.rotation)
        self.last_plan = plan
        for cand, why in plan.skipped:
            state = self.health.state(cand.key)
            self.skipped[cand.name] = story.Skipped(cand.name, why, state.until, state.reason)
        for cand, why in plan.skipped:
            if why == "expired" and (cand.name, cand.auth.expires_at) not in self.notices:
                self.notices.add((cand.name, cand.auth.expires_at))
                log.warning("credential %s: its ChatGPT access token expired at %s; it is skipped until refreshed. "
                            "Refresh it with `codex login` for that account (CODEX_HOME set to the folder of its "
                            "auth.json); codex-failover never refreshes tokens itself.", cand.name,
                            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cand.auth.expires_at)))
        return plan

    # -- one attempt -----------------------------------------------------------------------

    def _give_up(self, step: RecoveryExhausted) -> None:
        """Recovery exhausted: the final attempt's real answer. A stream that never ended is a
        request-scoped 408 that cools nothing; a final 5xx cools the credential as usual."""
        final = step.final
        if isinstance(final, http.Response):
            if final.status_code >= 500:
                self.health.cool(step.candidate.key, self.pool.policy.overload_cooldown, UPSTREAM_5XX)
            self._respond(final)
        elif callable(final):  # a buffered stream that ended in a terminal error: delivered as it came
            final()
        else:
            self._respond(client_answers.recovery_exhausted(step.why, self.history))

    async def _send(self, cand: Candidate, n: int, ep: Endpoint | None) -> Outcome:
        """Attempt `n`: the request on `cand`'s credential through `ep` (None: direct), until it is
        committed, answered, rejected or (recovery) worth retrying."""
        attempt = self._make_attempt(cand, n)
        attempt.endpoint = ep
        self.registry[attempt.flow.id] = attempt
        attempt.start(await self._via(ep))
        self._prewarm_next(cand)
        try:
            outcome = await self._drive(attempt, cand)
        except (ClientGone, asyncio.CancelledError):  # the run saw it, or the relay's hop closed
            self._record(attempt, cand, "cancelled", "client_gone", None)
            await attempt.cancel()
            raise
        except BaseException:
            await attempt.cancel()
            raise
        return outcome

    async def _via(self, ep: Endpoint | None):
        """mitmproxy's per-connection upstream proxy for `ep` (SOCKS goes through a local bridge)."""
        if ep is None:
            return None
        if ep.is_socks:
            return ("http", await self.bridges.address(ep))
        return (ep.scheme, (ep.host, ep.port))

    def _prewarm_next(self, current: Candidate) -> None:
        """Dial the connection the next candidate (by the plan) would use, if none is open or
        underway, so a failover pays no handshake (docs/architecture.md#warm-connections)."""
        plan = self.last_plan
        following = [c for c in plan.candidates if c.key != current.key] if plan is not None else []
        if not following or self.warm is None:
            return
        task = asyncio.get_running_loop().create_task(self._prewarm(following[0]))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # best effort: never an error

    async def _prewarm(self, cand: Candidate) -> None:
        url = http.Request.make("POST", (cand.base_url or self.original.url.rsplit("/", 1)[0]) + "/responses")
        endpoints = self.pool.routes.get(cand.route) or [None]
        ep = next((e for e in endpoints if e is None or self.route_health.healthy(e)), None)
        if ep is None and endpoints != [None]:
            return
        via = await self._via(ep)
        self.warm.prewarm(WarmKey(url.scheme, url.host, url.port, via), ep, self.pool.policy.connect_timeout)

    def _make_attempt(self, cand: Candidate, n: int) -> Attempt:
        attempt = Attempt(self.flow, f"{self.request_id}#{n}", n, self.warm)
        attempt.dial_timeout = self.pool.policy.connect_timeout
        attempt.flow.request = req = self.original.copy()
        if cand.base_url:
            req.url = cand.base_url + "/responses"
        if cand.auth is not None:
            swap_credential(req.headers, cand.auth, moved=not cand.is_client)
        if not cand.is_client and self.move.strip_reasoning:
            req.content = self._moved_body()
        req.headers.pop(PIN_HEADER, None)
        return attempt

    async def _drive(self, attempt: Attempt, cand: Candidate) -> Outcome:
        item = await self._first_item(attempt)
        if item is None and not attempt.connected:
            # Never connected: not one request byte left, so it may move (docs/architecture.md#replay-safety).
            waited = min(self.pool.policy.connect_timeout, self.pool.policy.response_timeout)
            outcome = self._connection_failed(attempt, cand, f"timed out connecting after {waited:g}s")
            await attempt.cancel()
            return outcome
        if item is None:
            self._record(attempt, cand, "failed", RESPONSE_TIMEOUT, None)
            await attempt.cancel()
            message = f"no response from upstream within {self.pool.policy.response_timeout:g}s"
            return Outcome("rejected", Rejection(RESPONSE_TIMEOUT, None, {"message": message}))
        if item.kind == ERROR:
            return self._connection_failed(attempt, cand, item.data.decode(errors="replace"))
        self._note_usage(cand, from_headers(attempt.flow.response.headers, self.health.now()))
        if attempt.streaming:
            return await self._bootstrap(attempt, cand)
        return await self._synchronous(attempt, cand)

    async def _first_item(self, attempt: Attempt) -> Item | None:
        """The response head (or an error); None when the connection was not up within
        connect_timeout, or no answer came within response_timeout."""
        policy = self.pool.policy
        started = time.monotonic()
        answer_by = started + policy.response_timeout  # each deadline holds on its own
        item = await self._next(attempt, min(started + policy.connect_timeout, answer_by))
        if item is None and attempt.connected:
            item = await self._next(attempt, answer_by)
        return item

    def _connection_failed(self, attempt: Attempt, cand: Candidate, message: str) -> Outcome:
        """Before any response: only a failure proven to precede dispatch may move (docs/architecture.md#replay-safety);
        the failover loop decides."""
        kind = classify_connection_error(message, response_started=False)
        self._record(attempt, cand, "failed", kind, None)
        if kind == TLS_FAILED:
            log.error("[%s] TLS verification to the upstream failed for credential %s: %s (not retried elsewhere)",
                      self.request_id, cand.name, message)
        # Host-wide network loss names the endpoint it came through (a pre-dispatch failure on an
        # endpoint is the route's: the loop names the endpoint in its route_down message).
        where = f"{attempt.endpoint.label}: " if attempt.endpoint and kind == HOST_NETWORK else ""
        return Outcome("rejected", Rejection(kind, 502 if kind in (PRE_DISPATCH, HOST_NETWORK) else None,
                                             {"message": where + message}))

    async def _synchronous(self, attempt: Attempt, cand: Candidate) -> Outcome:
        item = await self._next(attempt, time.monotonic() + self.pool.policy.response_timeout)
        if item is None or item.kind != END:
            self._record(attempt, cand, "failed", INCOMPLETE_RESPONSE, None)
            await attempt.cancel()
            return Outcome("rejected", Rejection(INCOMPLETE_RESPONSE, None, {"message": "upstream response did not complete"}))
        resp = attempt.flow.response
        verdict = classify_response(resp.status_code, resp.get_content(strict=False) or b"", self.rules)
        if self.pool.recovery.enabled and resp.status_code in RECOVERABLE_STATUS and not self._rejected_by_body(verdict.error):
            self._record(attempt, cand, "recover", f"status_{resp.status_code}", resp.status_code)
            return Outcome("recover", message=f"HTTP {resp.status_code}", final=resp.copy())
        if verdict.verdict == FAILOVER and not own_refusal(verdict.reason, cand):
            rejection = Rejection(verdict.reason, resp.status_code, dict(verdict.error or {}),
                                  retry_after=resp.headers.get("retry-after"))
            self._reject(attempt, cand, rejection)
            return Outcome("rejected", rejection)
        # Success without a stream, another 4xx, or the client's own 401/403: as is.
        self._respond(resp.copy())
        self._succeeded(cand)
        self._record(attempt, cand, "deliver", verdict.reason, resp.status_code, ok=True)
        return Outcome("answered")

    def _rejected_by_body(self, error) -> bool:
        """Does the error body itself name a rejection (overload, limits)? Those fail over; a bare
        transient status is recovery's to retry."""
        error = error or {}
        return self.rules.rejection_class(error.get("code"), error.get("type"), error.get("message")) is not None

    async def _bootstrap(self, attempt: Attempt, cand: Candidate) -> Outcome:
        clf = BootstrapClassifier(self.rules, timeout=self.pool.policy.bootstrap_timeout)
        framer = SSEFramer()
        tracker = TerminalTracker() if self.pool.recovery.enabled else None
        received = bytearray()
        state = {"ended": False, "error": None}
        decision: Decision | None = None
        while decision is None or not decision.final:
            item = await self._next(attempt, clf.deadline)
            if item is None:
                decision = clf.tick()
            elif item.kind == CHUNK:
                received += item.data
                decision = self._feed(framer, clf, item.data, lambda w: self._note_usage(cand, w), tracker)
            elif item.kind == END:
                state["ended"] = True
                decision = self._finish(framer, clf, tracker)
            else:  # the upstream broke while we held: deliver what came, then the break
                state["error"] = item.data.decode(errors="replace")
                decision = clf.fail_open("upstream_broken")
        if decision.verdict is Verdict.FAILOVER:
            resp = attempt.flow.response
            rejection = Rejection(decision.reason, resp.status_code, dict(decision.error or {}),
                                  retry_after=resp.headers.get("retry-after"))
            self._reject(attempt, cand, rejection)
            await attempt.cancel()
            return Outcome("rejected", rejection)
        if self.pool.recovery.enabled and self.recovery_slots.take(self.pool.recovery.max_concurrent):
            try:
                return await self._buffer_whole(attempt, cand, decision, framer, tracker, received, state)
            finally:
                self.recovery_slots.give_back()
        self._commit(attempt, cand, decision, bytes(received), state)
        return Outcome("committed")

    async def _buffer_whole(self, attempt: Attempt, cand: Candidate, decision: Decision, framer: SSEFramer,
                            tracker: TerminalTracker, received: bytearray, state: dict) -> Outcome:
        """Recovery: keep the committed stream until it ends. A complete (or finally failed) one is
        delivered whole; a transient failure asks for a retry. Past `max_buffer_bytes`, fail open:
        what is buffered goes out once, in order, and the rest streams live."""
        limit = self.pool.recovery.max_buffer_bytes
        if self.pool.recovery.heartbeat and self.sink is None:
            self._start_heartbeat()
        idle = self.pool.policy.response_timeout
        while not state["ended"] and state["error"] is None:
            if len(received) > limit:
                log.info("[%s] recovery: response over %d bytes; streaming the rest live", self.request_id, limit)
                self._commit(attempt, cand, decision, bytes(received), state)
                return Outcome("committed")
            item = await self._next(attempt, time.monotonic() + idle)
            if item is None:
                state["error"] = f"no data for {idle:g}s"
            elif item.kind == CHUNK:
                received += item.data
                self._track(framer, item.data, tracker)
            elif item.kind == END:
                state["ended"] = True
                self._track(framer, None, tracker)
            else:
                state["error"] = item.data.decode(errors="replace")
        if state["error"] is not None:
            self._record(attempt, cand, "recover", TRANSPORT, 200)
            await attempt.cancel()
            return Outcome("recover", message=f"transport error: {state['error']}")
        why = recoverable_stream_end(tracker.terminal, tracker.error)
        deliver = lambda: self._commit(attempt, cand, decision, bytes(received), state)  # noqa: E731
        if why is None:
            deliver()
            return Outcome("committed")
        self._record(attempt, cand, "recover", why, 200)
        return Outcome("recover", message=why, final=None if why == NO_TERMINAL else deliver)

    @staticmethod
    def _track(framer: SSEFramer, data: bytes | None, tracker: TerminalTracker) -> None:
        """Frame `data` (None: end of stream) only to see how the stream ends."""
        try:
            events = framer.close() if data is None else framer.feed(data)
        except FramerError:
            framer.take_pending()
            tracker.unframed()
            return
        for event in events:
            tracker.see(event)

    @staticmethod
    def _feed(framer: SSEFramer, clf: BootstrapClassifier, data: bytes, on_usage, tracker) -> Decision:
        """Classify the events of `data` until a decision; a recovery tracker sees all of them
        (a chunk may hold the deciding event and the stream's end)."""
        decision = clf.tick()
        try:
            events = framer.feed(data)
        except FramerError:
            if tracker is not None:
                tracker.unframed()
            return clf.fail_open(FRAMING_ERROR)
        for event in events:
            if not decision.final:
                decision = clf.feed(event)
                if event.type == "codex.rate_limits":  # parsed already by the classifier
                    on_usage(from_event(event.payload))
            if tracker is not None:
                tracker.see(event)
        return decision

    @staticmethod
    def _finish(framer: SSEFramer, clf: BootstrapClassifier, tracker) -> Decision:
        decision = None
        for event in framer.close():
            if decision is None or not decision.final:
                decision = clf.feed(event)
            if tracker is not None:
                tracker.see(event)
        return decision if decision is not None and decision.final else clf.end()

    # -- outcomes --------------------------------------------------------------------------

    def _commit(self, attempt: Attempt, cand: Candidate, decision: Decision, held: bytes, state: dict) -> None:
        resp = attempt.flow.response

        committed = time.monotonic()

        async def body():
            yield held
            if self.metrics is not None:  # the relay wrote the held bytes (the first output) and drained
                self.metrics.first_output_to_client_seconds(time.monotonic() - committed)
            if state["error"] is not None:
                raise UpstreamBroken(state["error"])
            if state["ended"]:
                return
            while True:
                item = await attempt.next_batch()
                if item.kind == CHUNK:
                    yield item.data
                elif item.kind == END:
                    return
                else:
                    raise UpstreamBroken(item.data.decode(errors="replace"))

        self.winner = attempt
        if self.sink is not None:
            self.sink.deliver(body)
        else:
            self._answer(resp.status_code, resp.reason, list(resp.headers.fields), body)
        self._succeeded(cand)
        verdict = decision.verdict.value
        self._record(attempt, cand, verdict, decision.reason, resp.status_code, ok=True)

    def _respond(self, answer: http.Response) -> None:
        """Answer the client: a whole response, or in heartbeat mode an in-stream failure."""
        if self.sink is None:
            content = answer.raw_content or b""

            async def body():
                yield content

            self._answer(answer.status_code, answer.reason, list(answer.headers.fields), body)
            return
        try:
            error = json.loads(answer.get_content(strict=False) or b"{}").get("error") or {}
        except ValueError:
            error = {}
        self.sink.fail(answer.status_code, error if isinstance(error, dict) else {"message": str(error)})

    def answer_internal_error(self, failure: str) -> None:
        """A bug ended the run before it answered: a clear status, never a hung client."""
        if self.sink is not None:
            self.sink.fail(502, {"type": "server_error", "code": "codex_failover_internal_error",
                                 "message": f"codex-failover internal error: {failure}"})
        elif not self.decided.is_set():
            self._respond(client_answers.internal_error(failure))

    def _start_heartbeat(self) -> None:
        """Heartbeat mode: commit 200 event-stream headers now; keepalives flow until the outcome."""
        self.sink = HeartbeatSink(self.pool.recovery.heartbeat)
        self._answer(200, "OK", list(HEADERS), self.sink.body)
        log.info("[%s] recovery: heartbeat every %gs while the response is buffered", self.request_id,
                 self.pool.recovery.heartbeat)

    def _answer(self, status: int, reason: str, headers: list, body) -> None:
        self._decided()
        self.hop.answer(status, reason, headers, body)

    def _abort(self):
        """The relay's reader left (or the hop ended): stop the run, and a committed stream's attempt."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.winner is not None:
            return self.winner.cancel()
        return None

    def _decided(self) -> None:
        if not self.decided.is_set() and self.metrics is not None:
            self.metrics.hold_seconds(time.monotonic() - self.started)
        self.decided.set()

    def _reject(self, attempt: Attempt, cand: Candidate, rejection: Rejection) -> None:
        if cools(cand, rejection):
            self._outcomes.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                                    rejection.retry_after, self.pool.policy, f"[{self.request_id}] ")
        self._record(attempt, cand, FAILOVER, rejection.reason, rejection.status)

    def _note_usage(self, cand: Candidate, windows: list[Window]) -> None:
        self._outcomes.usage_seen(cand.key, cand.name, windows, self.pool.policy, f"[{self.request_id}] ",
                                  cand.full_at)

    def _succeeded(self, cand: Candidate) -> None:
        self._outcomes.succeeded(cand.key, self.session)

    @property
    def _outcomes(self) -> Outcomes:
        return Outcomes(self.health, self.affinity, self.usage)

    def _answer_exhausted(self, last: Rejection, retry_after: int | None) -> None:
        answer = client_answers.exhausted(last, self.history, retry_after, self.move.why_pinned)
        self._count_exhausted(answer.status_code)
        self._respond(answer)
        self._log_summary(f"exhausted -> {answer.status_code}")

    def _answer_from_cooldown(self, states, retry_after: int | None) -> None:
        answer = client_answers.all_cooling(list(states), retry_after, self.move.why_pinned)
        self._count_exhausted(answer.status_code)
        self._respond(answer)
        self._log_summary(f"every credential cooling or out -> {answer.status_code} (not dialled)")

    def _answer_broken(self, message: str) -> None:
        answer = client_answers.upstream_failed(message, self.history)
        self._count_exhausted(answer.status_code)
        self._respond(answer)
        self._log_summary(f"upstream failed -> {answer.status_code}")

    def _count_exhausted(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.exhausted(status)

    # -- waiting while the client is held --------------------------------------------------

    async def _next(self, attempt: Attempt, deadline: float | None) -> Item | None:
        """The attempt's next item; None at `deadline`; ClientGone if the client left."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            item = await attempt.next(POLL if left is None else min(POLL, left))
            if item is not None:
                return item
            self._check_client()

    async def _sleep_holding(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL, left))
            self._check_client()

    def _check_client(self) -> None:
        if not self.flow.client_conn.state & ConnectionState.CAN_READ:
            raise ClientGone()

    # -- visibility ------------------------------------------------------------------------

    def _record(self, attempt: Attempt, cand: Candidate, verdict: str, reason: str, status: int | None,
                ok: bool = False) -> None:
        n, total = attempt.n, self.total
        elapsed = int((time.monotonic() - attempt.started) * 1000)
        route = attempt.endpoint.label if attempt.endpoint else "direct"
        entry = AttemptLog(n, cand.name, verdict, reason, elapsed, status, route)
        self.history.append(entry)
        attempt.judge(story.mark(verdict, reason, ok), story.attempt_comment(self.request_id, entry, total),
                      None if ok else story.attempt_error(verdict, reason))
        if self.metrics is not None:
            own = cand.is_client and cand.key.startswith("client:") and self.client_auth is not None
            self.metrics.attempt(seen_clients.label(self.client_auth) if own else cand.name, verdict, reason)
        self._tell_story()
        log.info("[%s] attempt %d/%d credential=%s route=%s verdict=%s reason=%s status=%s elapsed=%dms",
                 self.request_id, n, total, cand.name, route.replace(" ", "="), verdict, reason, status, elapsed)

    def _tell_story(self, outcome: str | None = None) -> None:
        """The client flow's comment: a summary line, then each attempt and each credential skipped."""
        self.flow.comment = story.request_comment(self.history, self.skipped, self.move.why_pinned, outcome,
                                                  self.request_id)
        shown_changed(self.flow)

    def _log_summary(self, what: str) -> None:
        self._tell_story(what)
        elapsed = int((time.monotonic() - self.started) * 1000)
        log.warning("[%s] %s after %d attempt(s), %dms", self.request_id, what, len(self.history), elapsed)
