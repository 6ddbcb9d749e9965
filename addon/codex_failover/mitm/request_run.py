"""The held request's driver: run the attempts the failover loop asks for, and answer the client.

Every decision comes from the pure core (failover_loop: which attempt is next, when to wait, when to
stop; planner, classifier, taxonomy, health). This module does the I/O around them: it starts each
attempt (attempt.py, over a warm connection), reads its response head, hands a stream to the SSE
hold (sse_hold.py), and answers the held client (held_client.py). The attempts come from an injected
engine (`Shared.engine`), so the driver runs in-process against a scripted one in tests.
docs/architecture.md, "The path of a model request".
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

from mitmproxy import http

from ..core import story
from ..core.affinity import affinity_key, session_of
from ..core.auth import AuthMaterial, auth_from_headers
from ..core.codex_request import COMPACT
from ..core.failover_loop import (
    AllCooling,
    Exhausted,
    FailoverLoop,
    Final,
    RecoveryExhausted,
    Rejection,
    RouteDown,
    Try,
    Wait,
    cools,
    own_refusal,
)
from ..core.planner import Candidate, Plan, make_plan
from ..core.pool_reach import unreachable
from ..core.provenance import artifacts_of_compact
from ..core.recovery import RECOVERABLE_STATUS
from ..core.replay_safety import MovePolicy, assess
from ..core.routes import Endpoint
from ..core.run_log import AttemptEnd, RunLog
from ..core.story import Skipped
from ..core.taxonomy import FAILOVER, UPSTREAM_5XX, classify_response
from ..core.transport import (
    HOST_NETWORK,
    INCOMPLETE_RESPONSE,
    PRE_DISPATCH,
    RESPONSE_TIMEOUT,
    TLS_FAILED,
    classify_connection_error,
)
from ..core.usage import Window, from_headers
from ..shared import Shared
from . import bounded_body, client_answers, secret_guard
from .attempt import END, ERROR, Attempt, Item, copy_request, hide_secrets
from .attempt_maker import AttemptMaker
from .client_hop import client_can_read
from .held_client import HeldClient, shown_changed
from .sse_hold import SseHold

log = logging.getLogger("codex_failover")

POLL = 0.25  # how often a held request checks that its client is still there


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
        self.session: str | None = None  # the client's key and its Codex session (thread) id: affinity's key
        self.winner: Attempt | None = None  # the committed attempt, streaming through the relay
        self.last_plan: Plan | None = None  # for pre-warming the next candidate's connection
        self.dispatched = asyncio.Event()  # the first attempt's head was written, or the run ended
        self.client_auth = client_auth  # the client's own credential (read from its request when not given)

    def hold(self) -> None:
        """Give the client flow its hop now, before any attempt (docs/architecture.md#the-hop)."""
        self.original = copy_request(self.flow.request)  # the flow shows no secret from here on
        self.client.hold()

    async def run(self) -> None:
        if self.original is None:
            self.hold()
        req = self.original
        hide_secrets(self.flow.request)
        self.move = assess(self.body, req.headers, self.pool.policy.encrypted_reasoning, self.shared.provenance.owner)
        self.log.why_pinned = self.move.why_pinned
        if not self.move.movable:
            log.info("[%s] %s: %s", self.request_id, story.bound_to(self.move.bound_to, self.pool), self.move.why_pinned)
            self.log.tell()
        if self.client_auth is None:
            self.client_auth = auth_from_headers(req.headers)
        self.log.client_auth = self.client_auth
        self.session = affinity_key(self.client_auth.fingerprint if self.client_auth else None,
                                    session_of(req.headers, self.body))
        self.maker = AttemptMaker(self, req)
        self.body = None  # the maker has it (for a moved copy), and lets it go once built
        loop = FailoverLoop(self._plan, self.health, self.shared.route_health, self.pool, tell=self._tell)
        self.log.total = loop.total
        try:
            await self._follow(loop)
        except BaseException:
            loop.abandon()  # an attempt the client left (or a bug) must not keep its endpoint claimed
            raise

    async def _follow(self, loop: FailoverLoop) -> None:
        while True:
            match loop.next():
                case Try(cand, ep, n):
                    end = await self._send(cand, n, ep)
                    loop.report(end.result())
                    if end.kind in ("committed", "answered"):
                        return
                case Wait(seconds, _):
                    await self._sleep_holding(seconds)  # a client that leaves stops everything here
                case RouteDown(cand, rejection):
                    log.warning("[%s] credential %s: %s (the credential is not penalised)", self.request_id,
                                cand.name, rejection.error["message"])
                case RecoveryExhausted() as step:
                    return self._give_up(step)
                case Final(rejection):
                    return self._answer(client_answers.upstream_failed(rejection.error.get("message") or rejection.reason,
                                                                       self.log.history), "upstream failed")
                case Exhausted(last, retry_after, first):
                    answer = client_answers.exhausted(last, self.log.history, retry_after, self.move.why_pinned, first)
                    return self._answer(answer, "exhausted")
                case AllCooling(states, _) if not states and (why := unreachable(self.client_auth, self.pool,
                                                                                 self.move.movable)):
                    return self._answer(client_answers.no_pool_credential(why), "no pool credential for it",
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
                         self.move.bound_to)
        first, self.last_plan = self.last_plan is None, plan
        if first and plan.skipped and plan.candidates:  # (with nothing to try, the answer says it)
            log.info("[%s] not tried: %s", self.request_id, "; ".join(
                story.skipped_line(c.name, why, self.health.state(c.key), self.health.now()) for c, why in plan.skipped))
        for cand, why in plan.skipped:
            state = self.health.state(cand.key)
            self.log.skipped[cand.name] = Skipped(cand.name, why, state.until, state.reason)
            if why == "expired":
                _expired_once(shared.notices, cand)
        return plan

    # -- one attempt -----------------------------------------------------------------------

    async def _send(self, cand: Candidate, n: int, ep: Endpoint | None) -> AttemptEnd:
        """Attempt `n`: the request on `cand`'s credential through `ep` (None: direct), until it is
        committed, answered, rejected or (recovery) worth retrying."""
        attempt = self.maker.make(cand, n)
        attempt.on_sent = self.dispatched.set
        attempt.endpoint = ep
        self.shared.attempts[attempt.flow.id] = attempt
        attempt.start(await self.maker.via(ep))
        self.maker.prewarm_next(self.last_plan, cand)
        try:
            return await self._read(attempt, cand)
        except (ClientGone, asyncio.CancelledError):  # the run saw it, or the relay's hop closed
            self.log.record(attempt, cand, "cancelled", "client_gone", None)
            await attempt.cancel()
            raise
        except BaseException:
            await attempt.cancel()
            raise

    async def _read(self, attempt: Attempt, cand: Candidate) -> AttemptEnd:
        """The attempt's response head, then its body: streamed (the SSE hold) or whole."""
        item = await self._first_item(attempt)
        if item is None and not attempt.connected:
            # Never connected: not one request byte left, so it may move (docs/architecture.md#replay-safety).
            waited = min(self.pool.policy.connect_timeout, self.pool.policy.response_timeout)
            end = self._connection_failed(attempt, cand, f"timed out connecting after {waited:g}s")
            await attempt.cancel()
            return end
        if item is None:
            self.log.record(attempt, cand, "failed", RESPONSE_TIMEOUT, None)
            await attempt.cancel()
            message = f"no response from upstream within {self.pool.policy.response_timeout:g}s"
            return AttemptEnd("rejected", Rejection(RESPONSE_TIMEOUT, None, {"message": message}))
        if item.kind == ERROR:
            return self._connection_failed(attempt, cand, item.data.decode(errors="replace"))
        self.note_usage(cand, from_headers(attempt.flow.response.headers, self.health.now()))
        if attempt.streaming:
            return await SseHold(self, attempt, cand).run_hold()
        return await self._whole(attempt, cand)

    async def _first_item(self, attempt: Attempt) -> Item | None:
        """The response head (or an error); None when the connection was not up within
        connect_timeout, or no answer came within response_timeout."""
        policy = self.pool.policy
        started = time.monotonic()
        answer_by = started + policy.response_timeout  # each deadline holds on its own
        item = await self.next_item(attempt, min(started + policy.connect_timeout, answer_by))
        if item is None and attempt.connected:
            item = await self.next_item(attempt, answer_by)
        return item

    def _connection_failed(self, attempt: Attempt, cand: Candidate, message: str) -> AttemptEnd:
        """Before any response: only a failure proven to precede dispatch may move
        (docs/architecture.md#replay-safety); the failover loop decides."""
        kind = classify_connection_error(message, response_started=False)
        self.log.record(attempt, cand, "failed", kind, None)
        if kind == TLS_FAILED:
            log.error("[%s] TLS verification to the upstream failed for credential %s: %s (not retried elsewhere)",
                      self.request_id, cand.name, message)
        # Host-wide network loss names the endpoint it came through (a pre-dispatch failure on an
        # endpoint is the route's: the loop names the endpoint in its route_down message).
        where = f"{attempt.endpoint.label}: " if attempt.endpoint and kind == HOST_NETWORK else ""
        return AttemptEnd("rejected", Rejection(kind, 502 if kind in (PRE_DISPATCH, HOST_NETWORK) else None,
                                                {"message": where + message}))

    async def _whole(self, attempt: Attempt, cand: Candidate) -> AttemptEnd:
        """A response that is not an event stream: read whole, then classified."""
        item = await self.next_item(attempt, time.monotonic() + self.pool.policy.response_timeout)
        if item is None or item.kind != END:
            self.log.record(attempt, cand, "failed", INCOMPLETE_RESPONSE, None)
            await attempt.cancel()
            return AttemptEnd("rejected", Rejection(INCOMPLETE_RESPONSE, None, {"message": "upstream response did not complete"}))
        resp = attempt.flow.response
        body = await bounded_body.answer(resp, f"[{self.request_id}] credential {cand.name}")  # never get_content()
        verdict = classify_response(resp.status_code, body.content or b"", self.rules)
        if self.pool.recovery.enabled and resp.status_code in RECOVERABLE_STATUS and not self._rejected_by_body(verdict.error):
            self.log.record(attempt, cand, "recover", f"status_{resp.status_code}", resp.status_code)
            return AttemptEnd("recover", message=f"HTTP {resp.status_code}", final=secret_guard.forwarded(resp, body, cand.is_client))
        if verdict.verdict == FAILOVER and not own_refusal(verdict.reason, cand):
            rejection = Rejection(verdict.reason, resp.status_code, dict(verdict.error or {}),
                                  retry_after=resp.headers.get("retry-after"))
            self.reject(attempt, cand, rejection)
            return AttemptEnd("rejected", rejection)
        # Success without a stream, another 4xx, or the client's own 401/403: as is (pooled errors masked).
        if 200 <= resp.status_code < 300 and self.flow.request.path.split("?", 1)[0].endswith(COMPACT):
            self.made(cand, artifacts_of_compact(body.content or b""))  # decoded above, bounded
        if own_refusal(verdict.reason, cand):
            self.shared.feedback.client_refused(self.client_auth)
        self.client.respond(secret_guard.forwarded(resp, body, cand.is_client))
        self.succeeded(cand)
        self.log.record(attempt, cand, "deliver", verdict.reason, resp.status_code, ok=True)
        return AttemptEnd("answered")

    def _rejected_by_body(self, error) -> bool:
        """Does the error body itself name a rejection (overload, limits)? Those fail over; a bare
        transient status is recovery's to retry."""
        error = error or {}
        return self.rules.rejection_class(error.get("code"), error.get("type"), error.get("message")) is not None

    # -- what an attempt does to the pool ------------------------------------------------------

    def reject(self, attempt: Attempt, cand: Candidate, rejection: Rejection) -> None:
        if cools(cand, rejection):
            self.shared.feedback.rejected(cand.key, cand.name, rejection.reason, rejection.status, rejection.error,
                                          rejection.retry_after, self.pool.policy, f"[{self.request_id}] ")
        self.log.record(attempt, cand, FAILOVER, rejection.reason, rejection.status)

    def note_usage(self, cand: Candidate, windows: list[Window]) -> None:
        self.shared.feedback.usage_seen(cand.key, cand.name, windows, self.pool.policy, f"[{self.request_id}] ",
                                        cand.full_at)

    def succeeded(self, cand: Candidate) -> None:
        self.shared.feedback.succeeded(cand.key, self.session)

    def made(self, cand: Candidate, artifacts: list[str]) -> None:
        """`cand`'s credential made these artifacts (response ids, compaction and reasoning items)."""
        if artifacts:
            self.shared.provenance.record(artifacts, cand.key)

    # -- answers ------------------------------------------------------------------------------

    def _give_up(self, step: RecoveryExhausted) -> None:
        """Recovery exhausted: the final attempt's real answer. A stream that never ended is a
        request-scoped 408 that cools nothing; a final 5xx cools the credential as usual."""
        final = step.final
        if isinstance(final, http.Response):
            if final.status_code >= 500:
                self.health.cool(step.candidate.key, self.pool.policy.overload_cooldown, UPSTREAM_5XX)
            self.client.respond(final)
        elif callable(final):  # a buffered stream that ended in a terminal error: delivered as it came
            final()
        else:
            self.client.respond(client_answers.recovery_exhausted(step.why, self.log.history))

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
            if item is not None:
                return item
            self._check_client()

    async def _sleep_holding(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL, left))
            self._check_client()

    def _check_client(self) -> None:
        if not client_can_read(self.flow):
            raise ClientGone()


def _expired_once(notices: set, cand: Candidate) -> None:
    """One warning per expired token (the plan skips it at every request until it is refreshed)."""
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
        run.dispatched.set()
        if not run.client.answered:  # the client left, or a bug: the relay hop must end too
            run.client.internal_error("the request ended without an answer")
        on_done(run)

    run.task.add_done_callback(ended)
    return run.task


async def _guarded(run: RequestRun) -> str | None:
    """Run one request; a bug must fail with a clear status, never hang the client."""
    try:
        await run.run()
    except (ClientGone, asyncio.CancelledError):  # seen by the run, or the relay's hop closed
        log.info("[%s] client went away while held; attempts cancelled", run.request_id)
        return "client_gone"
    except Exception as exc:  # noqa: BLE001
        log.error("[%s] codex-failover internal error: %s\n%s", run.request_id, exc, traceback.format_exc())
        run.client.internal_error(type(exc).__name__)
        return type(exc).__name__
    return None
