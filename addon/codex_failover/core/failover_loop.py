"""The failover loop: which credential and route endpoint the next attempt goes to, how long to hold
the client first, and when to stop. Sans-I/O and shared by both transports: the HTTP path
(`request_run.RequestRun`) and the WebSocket gate's handshakes (`ws_dial.Dialer`). No mitmproxy, no
asyncio, no I/O; time comes only from the clocks it is given (Health's, RouteHealth's, and its own
for recovery's retry window).

A shell drives it:

    while True:
        step = loop.next()
        Try(candidate, endpoint, n)    send attempt n on `candidate` through `endpoint` (None: direct),
                                       then loop.report(Served / Rejected / Transient)
        Wait(seconds, why)             hold the client that long (checking it is still there); ask again
        RouteDown(candidate, rejection)   no endpoint of the candidate's route could be used: the shell
                                       records it (nothing cools) and asks again
        Exhausted, AllCooling, Final, RecoveryExhausted   answer the client; done

What the loop decides:
- the order: the plan's untried candidates (planned again after every rejection), at most
  `max_attempts` of them, and `total` (the N of "attempt n/N");
- the only credential (no pool alternative, or pinned) is retried after 0.5/1/2/4 s, or upstream's
  hint if longer, for the reasons in RETRY_SAME, as long as that stays within `cooldown_wait`;
- otherwise, with nothing ready, holding for the first credential that recovers within `cooldown_wait`,
  or else probing once the least recently failed credential resting for an overload;
- each candidate's route endpoints in order (claimed on RouteHealth): a pre-dispatch failure backs the
  endpoint off and the next one is tried without costing an attempt; host-wide network loss releases it
  without blame; any other result is the endpoint's success; none usable: a ROUTE_DOWN rejection (502);
- which failures must not move (`Final`): a TLS verification failure fails closed; a failure after the
  request may have reached upstream is never replayed (a WebSocket handshake carries no conversation,
  so there it may move); the client's own credential refused (401/403) is the client's own answer;
- recovery's retries on the same candidate and endpoint (RetryBudget), and when they run out;
- the answer's Retry-After: the soonest recovery, capped by `max_retry_after` (none when it is 0);
- whether a rejection cools its credential (`cools`): never for ROUTE_DOWN, a connection or handshake
  failure, or the client's own 401/403.

What the shells do: send attempts and classify what comes back, build the `Rejection`, apply rejections
and successes to Health (pool_feedback.PoolFeedback, as `cools` says), sleep while checking the client is still
there, answer the client, and record attempts (flow comments, history, metrics). The log lines of the
loop's own decisions (an endpoint backing off, holding for a credential, recovery's retries) come
through `tell`, in the words the shells used before; each shell logs its answers and RouteDown itself.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Iterable

from .health import COOLING, Health
from .outcomes import (
    BACKOFF,
    PROBING,
    RECOVERING,
    RECOVERY_RETRY,
    AllCooling,
    Exhausted,
    Final,
    LoopStep,
    RecoveryExhausted,
    Rejection,
    Result,
    RouteDown,
    Served,
    Transient,
    Try,
    Wait,
    own_refusal,
)
from .planner import NOT_ENTITLED, Candidate, Plan
from .policy import Policy, PoolConfig
from .pool_wait import retry_after as true_retry_after, soonest
from .recovery import RetryBudget
from .routes import Endpoint, RouteHealth
from .taxonomy import hinted_seconds
from .vocabulary import (
    AMBIGUOUS,
    AS_IT_CAME,
    CLOSED_BEFORE_OUTPUT,
    FORBIDDEN_PAGE,
    HOST_NETWORK,
    INCOMPLETE_RESPONSE,
    MODEL_NOT_ENTITLED,
    NOT_PROCESSED,
    OVERLOAD_CLASSES,
    OVERLOADED,
    PRE_DISPATCH,
    RESPONSE_TIMEOUT,
    ROUTE_CLASSES,
    ROUTE_DOWN,
    SERVER_ERROR_RETRYABLE,
    SLOW_DOWN,
    STALLED_BEFORE_OUTPUT,
    TLS_FAILED,
    UPSTREAM_5XX,
)

# Rejections worth retrying on the same credential when it is the only one (with backoff).
RETRY_SAME = frozenset({OVERLOADED, SLOW_DOWN, SERVER_ERROR_RETRYABLE, CLOSED_BEFORE_OUTPUT, STALLED_BEFORE_OUTPUT,
                        UPSTREAM_5XX, NOT_PROCESSED, FORBIDDEN_PAGE, *ROUTE_CLASSES})

SAME_CREDENTIAL_BACKOFF = (0.5, 1.0, 2.0, 4.0)
# The only credential resting for an overload (a guess, not a fact): probed once after this long.
PROBE_DELAY = SAME_CREDENTIAL_BACKOFF[0]
# The request may have reached upstream: never replayed elsewhere (docs/architecture.md#replay-safety).
MAY_HAVE_BEEN_SENT = frozenset({AMBIGUOUS, RESPONSE_TIMEOUT, INCOMPLETE_RESPONSE})

def backoff_delay(last: Rejection, n: int, cooldown_wait: float, now: float) -> float | None:
    """How long before attempt n+1 on the same credential after `last` rejected attempt n: 0.5 s,
    1 s, 2 s, 4 s, or upstream's hint if longer; None when the rejection is not worth retrying there
    or the delay exceeds `cooldown_wait`. One rule for an HTTP request's only credential and a gated
    turn that cannot leave its socket (core/turn_machine.py)."""
    if last.reason not in RETRY_SAME:
        return None
    hinted = hinted_seconds(last.error or {}, last.retry_after, now) or 0.0
    delay = max(SAME_CREDENTIAL_BACKOFF[max(0, min(n - 1, len(SAME_CREDENTIAL_BACKOFF) - 1))], hinted)
    return delay if delay <= cooldown_wait else None


def probe_delay(health: Health, key: str, policy: Policy) -> float | None:
    """How soon the only credential, resting for an overload (a guess, not a fact), is probed once:
    PROBE_DELAY, or sooner if it is back sooner. None: it does not rest for an overload (a usage limit
    is a fact; out of rotation is no rest), or no wait is allowed."""
    state = health.state(key)
    if state.status != COOLING or state.reason not in OVERLOAD_CLASSES or PROBE_DELAY > policy.cooldown_wait:
        return None
    recovers = health.recovers_in(key)
    return max(0.001, min(PROBE_DELAY, recovers if recovers is not None else PROBE_DELAY))


def _silent(level: int, text: str) -> None:
    pass


class FailoverLoop:
    """One request's (or one WebSocket turn's) attempts, `plan()` in policy order (asked again after each
    rejection). `handshake`: any failure but TLS may move; `waits` (a gated turn's; not an upgrade's, a
    426 sends Codex to SSE): HTTP's backoff and hold. `tried`, `n`, `last` carry on a turn's sockets."""

    def __init__(self, plan: Callable[[], Plan], health: Health, route_health: RouteHealth, pool: PoolConfig, *,
                 handshake: bool = False, waits: bool | None = None, tried: Iterable[str] = (), n: int = 0,
                 last: Rejection | None = None, tell: Callable[[int, str], None] = _silent,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random,
                 model: str | None = None):
        self._replan, self.health, self.route_health, self.pool = plan, health, route_health, pool
        self.policy = pool.policy
        self.handshake = handshake
        self.waits = not handshake if waits is None else waits
        self.tried: set[str] = set(tried)
        self.n = n  # attempts made (an endpoint that failed before dispatch costs none)
        self.last: Rejection | None = last
        self.model = model  # the request's model (a typo'd one moves once at most)
        self._lacked = 0  # how many credentials said they lack it, in this request
        self._as_it_came: Rejection | None = None  # the upstream answer the client gets should nothing serve
        self._as_it_came_own = False  # it is the client's own credential's
        self._probed = False  # a credential was dialled through its overload rest (the only one, or `_probing`)
        self._probing: Candidate | None = None  # the resting credential probed when there are others
        self._claim: str | None = None  # its key, claimed on Health (one probe at a time) until the probe ends
        self._tell, self._clock, self._rand = tell, clock, rand
        self.plan = plan()
        everyone = [*self.plan.candidates, *(c for c, _ in self.plan.skipped)]
        self.only = everyone[0] if len(everyone) == 1 else None  # the one and only credential, if so
        self.total = self.policy.max_attempts if self.only else min(self.policy.max_attempts, len(self.plan.all_keys))
        self._stale = False  # plan again before choosing
        self._cand: Candidate | None = None  # the candidate in hand
        self._ep: Endpoint | None = None  # its endpoint, claimed, while its attempt is unsettled
        self._endpoints: list[Endpoint] = []  # its route's endpoints not yet tried
        self._failures: list[str] = []  # why each of its endpoints could not be used
        self._walk_on = False  # the endpoint failed before dispatch: the next one is tried
        self._budget: RetryBudget | None = None  # recovery's, for the candidate and endpoint in hand
        self._transient: Transient | None = None  # reported, not yet retried
        self._retry = False  # the recovery wait is over: try the same again
        self._waited: str | None = None  # the wait just decided (BACKOFF, RECOVERING or PROBING)
        self._decided: LoopStep | None = None  # settled by report(), given by the next next()

    # -- the shell's two calls ----------------------------------------------------------------

    def next(self) -> LoopStep:
        if self._decided is not None:
            decided, self._decided = self._decided, None
            return decided
        if self._transient is not None:
            transient, self._transient = self._transient, None
            return self._retry_or_give_up(transient)
        if self._retry:
            self._retry = False
            return Try(self._in_hand, self._ep, self.n)
        if self._walk_on:
            return self._next_endpoint()
        return self._choose()

    def report(self, result: Result) -> bool:
        """What the last Try's attempt came to. Returns False only when the result took just its
        endpoint out (it failed before dispatch: the next endpoint is tried, and nothing of it is
        the credential's to record); True otherwise."""
        ep = self._ep
        self._release_probe()  # (a probe's result, whatever it is, ends its claim)
        if isinstance(result, Transient):
            self._transient = result  # the endpoint stays claimed for the retry
            return True
        if isinstance(result, Served):
            if ep is not None:
                self.route_health.succeeded(ep)
            self._settle()
            return True
        rejection = result.rejection
        if ep is not None and rejection.reason == PRE_DISPATCH:
            message = str(rejection.error.get("message") or "")
            backoff = self.route_health.failed(ep, message)
            self._tell(logging.WARNING, f"{ep.label} failed before dispatch ({message}); "
                                        f"not dialled again for {int(backoff)}s")
            # Worded as each transport did: HTTP names the failure, a handshake the backoff too (it
            # reaches the client either way: the HTTP 502, the WebSocket's 426).
            why = self.route_health.describe(ep) if self.handshake else message
            self._failures.append(f"{ep.label}: {why}")
            self._ep, self._walk_on = None, True
            return False
        if ep is not None:
            if rejection.reason == HOST_NETWORK:
                self.route_health.release(ep)  # not the route's fault
            elif rejection.reason in ROUTE_CLASSES:  # the edge refused this egress (to this credential, so far)
                everyone, backoff = self.route_health.edge_refused(ep, self._in_hand.key,
                                                                   f"the edge refused it ({rejection.reason})")
                if everyone:
                    self._tell(logging.WARNING, f"{ep.label}: the edge refused the request ({rejection.reason}) to "
                                                f"a second credential; not dialled again for {int(backoff)}s")
                else:
                    self._tell(logging.WARNING, f"{ep.label}: the edge refused credential {self._in_hand.name} "
                                                f"({rejection.reason}); it is not sent through it for {int(backoff)}s "
                                                f"(the endpoint stays up for the others)")
            else:
                self.route_health.succeeded(ep)
        self._settle(rejection)
        self._keep_as_it_came(rejection)
        if self._must_not_move(rejection):
            self._decided = Final(rejection)
        return True

    def _keep_as_it_came(self, rejection: Rejection) -> None:
        """The first answer of a class the client gets as it came (the client's own preferred: it speaks
        of the client's own setup), and how many credentials said they lack the model."""
        if rejection.reason == MODEL_NOT_ENTITLED:
            self._lacked += 1
        if rejection.reason in AS_IT_CAME and (self._as_it_came is None or self._in_hand.is_client
                                               and not self._as_it_came_own):
            self._as_it_came, self._as_it_came_own = rejection, self._in_hand.is_client

    def rejected_later(self, rejection: Rejection) -> None:  # its socket opened, then its turn was rejected
        self._settle(rejection)

    def abandon(self) -> None:
        """The attempt in flight ended without a verdict (the client left, a bug): its endpoint is
        released, so an unfinished probe never keeps it claimed."""
        self._release_probe()
        if self._ep is not None:
            self.route_health.release(self._ep)
            self._ep = None

    # -- choosing -----------------------------------------------------------------------------

    def _choose(self) -> LoopStep:
        if self._stale:
            self.plan, self._stale = self._replan(), False
        waited, self._waited = self._waited, None
        if waited == PROBING:  # a probe among several: still one to probe?
            probe = self._probing
            assert probe is not None, "a probe's wait without its credential"
            self.plan = self._replan()
            if not any(c.key == probe.key for c in (*self.plan.candidates, *self._probeable(self.plan, probe.key))):
                self._release_probe()  # out of rotation, at its usage limit or gone meanwhile: never sent
                return self._end()
            return self._start(probe)  # its own cooldown notwithstanding
        if waited == BACKOFF:  # (a backoff is only ever for the only one)
            assert self.only is not None, "a backoff without its credential"
            return self._start(self.only)  # its own cooldown notwithstanding
        if waited == RECOVERING:
            queue = self._untried(self._replan())
            return self._start(queue[0]) if queue else self._end()
        if self.n >= self.policy.max_attempts or self._typo():
            return self._end()
        queue = self._untried(self.plan)
        return self._start(queue[0]) if queue else self._wait()

    def _typo(self) -> bool:
        """Enough credentials said they lack a model none was seen serving (a typo'd name is not sent to
        every account of the pool: entitlement.UNKNOWN_MODEL_TRIES, docs/decisions.md#a-model-nobody-was-seen-serving)."""
        return self.health.models.likely_no_model(self.model, self._lacked)

    def _untried(self, plan: Plan) -> list[Candidate]:
        return [c for c in plan.candidates if c.key not in self.tried]

    def _wait(self) -> LoopStep:
        """Nothing ready and untried: the only credential's backoff, or its probe when it rests for an
        overload; else hold for an untried one back within `cooldown_wait`; else probe the least recently
        failed one resting for an overload, once (an upgrade never waits)."""
        if not self.waits:
            return self._end()
        if self.only is not None and self.last is not None:  # (after a failed probe: the rest was right)
            delay = None if self._probed else backoff_delay(self.last, self.n, self.policy.cooldown_wait, self.health.now())
            if delay is None:
                return self._end()
            self._waited = BACKOFF
            return Wait(delay, BACKOFF)
        if self.only is not None and not self._probed and self.only in self._resting(self.plan) \
                and (delay := probe_delay(self.health, self.only.key, self.policy)):
            self._probed, self._waited = True, BACKOFF
            self._tell(logging.INFO, f"credential {self.only.name} rests for an overload; probing it in {delay:.1f}s")
            return Wait(delay, BACKOFF)
        waits = [w for k in self.plan.all_keys if k not in self.tried and (w := self.health.recovers_in(k)) is not None]
        if waits and min(waits) <= self.policy.cooldown_wait:
            self._tell(logging.INFO, f"no credential ready; holding {min(waits):.1f}s for the first to recover")
            self._waited = RECOVERING
            return Wait(min(waits), RECOVERING)
        if self.retry_after() is not None:
            return self._end()  # one back within max_retry_after: its Retry-After, and the re-send it serves
        probe = None if self._probed else self._least_recently_failed()
        if probe is not None and (delay := probe_delay(self.health, probe.key, self.policy)) \
                and self.health.probes.claim(probe.key, self.health.now()):
            self._probed, self._probing, self._claim, self._waited = True, probe, probe.key, PROBING
            self._tell(logging.INFO, f"no credential ready; probing {probe.name} in {delay:.1f}s (resting for an "
                                     f"overload, the least recently failed)")
            return Wait(delay, PROBING)
        return self._end()

    def _least_recently_failed(self) -> Candidate | None:
        """Of the untried credentials resting for an overload (a guess, not a fact), the one whose last
        overload is the oldest: probed once, as the only credential is, so that a pool whose every
        account rests (the client's own plus one spare: `max_held_out` never brings the own back) is
        still dialled once a request instead of answered "every credential cooling" for the whole rest.
        None when the whole pool may rest (`max_held_out: 100%`, the old behaviour: nothing comes back early)."""
        if self.policy.overload.max_held_out >= 1.0:
            return None
        return min(self._probeable(self.plan), key=lambda c: self.health.streaks.last_failed(c.key), default=None)

    def _resting(self, plan: Plan) -> list[Candidate]:
        """The plan's untried credentials it skipped as cooling (not expired, not out) for an overload."""
        return [c for c, why in plan.skipped
                if why == COOLING and c.key not in self.tried and probe_delay(self.health, c.key, self.policy) is not None]

    def _probeable(self, plan: Plan, claimed: str | None = None) -> list[Candidate]:
        """Those a probe among several may go to: not being probed by another request (but `claimed`,
        this one's)."""
        now = self.health.now()
        return [c for c in self._resting(plan) if c.key == claimed or not self.health.probes.held(c.key, now)]

    def _release_probe(self) -> None:
        """The probe's claim goes (once: another request may hold the next one)."""
        if self._claim is not None:
            self.health.probes.release(self._claim)
            self._claim = None

    def _start(self, cand: Candidate) -> LoopStep:
        self.n += 1
        self.tried.add(cand.key)
        self._cand = cand
        self._endpoints = list(self.pool.routes.get(cand.route) or ())
        self._failures = []
        if not self._endpoints:
            self._ep, self._budget = None, None
            return Try(cand, None, self.n)
        return self._next_endpoint()

    def _next_endpoint(self) -> LoopStep:
        """The candidate's next endpoint that may be dialled; none left: its route is down."""
        self._walk_on = False
        while self._endpoints:
            ep = self._endpoints.pop(0)
            if self.route_health.claim(ep, self._in_hand.key):
                self._ep, self._budget = ep, None
                return Try(self._in_hand, ep, self.n)
            self._failures.append(f"{ep.label}: {self.route_health.describe(ep, self._in_hand.key)}")
        message = f"route {self._in_hand.route}: no endpoint could be used ({'; '.join(self._failures)})"
        rejection = Rejection(ROUTE_DOWN, 502, {"message": message})
        self._settle(rejection)
        return RouteDown(self._in_hand, rejection)

    @property
    def _in_hand(self) -> Candidate:
        """The candidate being tried: `_start` sets it before the first Try, so it is there
        wherever a Try, its endpoints or its result are dealt with."""
        assert self._cand is not None, "no candidate in hand"
        return self._cand

    def _settle(self, rejection: Rejection | None = None) -> None:
        """The candidate in hand is done with (served or rejected): plan again before choosing."""
        self._ep, self._stale = None, True
        if rejection is not None:
            self.last = rejection

    def _must_not_move(self, rejection: Rejection) -> bool:
        if rejection.reason == TLS_FAILED or own_refusal(rejection.reason, self._in_hand):
            return True
        return not self.handshake and rejection.reason in MAY_HAVE_BEEN_SENT

    # -- recovery -------------------------------------------------------------------------------

    def _retry_or_give_up(self, transient: Transient) -> LoopStep:
        self._budget = self._budget or RetryBudget(self.pool.recovery, self._clock, self._rand)
        delay = self._budget.next_delay()
        if delay is None:
            self._tell(logging.WARNING, f"recovery exhausted on credential {self._in_hand.name}: {transient.why}")
            if self._ep is not None:
                self.route_health.succeeded(self._ep)  # the endpoint carried every retry
            self._settle()
            return RecoveryExhausted(self._in_hand, transient.why, transient.final)
        self._tell(logging.INFO, f"recovery: {transient.why} on credential {self._in_hand.name}; "
                                 f"retry {self._budget.retries} in {delay * 1000:.0f} ms")
        self._retry = True
        return Wait(delay, RECOVERY_RETRY)

    # -- the end --------------------------------------------------------------------------------

    def _end(self) -> Exhausted | AllCooling:
        first = soonest(self.health, self.plan.all_keys)
        retry_after = self.retry_after()
        if self.last is None:
            states = tuple((c.name, why, self.health.state(c.key).reason) for c, why in self.plan.skipped) + \
                tuple((c.name, NOT_ENTITLED, None) for c in self.plan.lacking)
            return AllCooling(states, retry_after, first)
        # The edge's 403 or the model's answer decided (a route down after an edge refusal is its echo) and
        # no credential comes back: the client sees what the service said ("region not supported", "model
        # not supported"), not an answer of ours.
        decided = self.last.reason in AS_IT_CAME or self.last.reason == ROUTE_DOWN
        as_it_came = self._as_it_came if decided and first is None else None
        return Exhausted(self.last, retry_after, first, as_it_came)

    def retry_after(self) -> int | None:
        """Seconds for Retry-After: the soonest recovery, when it is within `max_retry_after`; None (no
        header) when it is later (a promise nobody keeps: Codex would sit through it silently before
        each of its re-sends, docs/architecture.md#what-codex-does-with-our-answers) or the cap is 0."""
        # A credential this request just tried that is ready again (back early: the share held out
        # for overload; or not cooled: its route is down) is no promise that a re-send is served.
        waits = [w for k in self.plan.all_keys if (w := self.health.recovers_in(k)) is not None
                 and not (w == 0 and k in self.tried)]
        return true_retry_after(waits, self.policy.max_retry_after)
