"""The failover loop's decisions, branch by branch, on an injected clock (issue 17).

Each case runs a FailoverLoop against a script of attempt results and compares the decisions it
took, as a transcript, with what today's shells decided. The driver does what both shells do: it
reports each attempt's result, cools a rejected credential when `cools` says so, and lets the
clock run through each Wait."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from conftest import Clock

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.affinity import Affinity
from codex_failover.core.auth import APIKEY, AuthMaterial
from codex_failover.core.cooldown_policy import OverloadPolicy
from codex_failover.core.failover_loop import FailoverLoop
from codex_failover.core.health import Health
from codex_failover.core.outcomes import (
    BACKOFF,
    PROBING,
    RECOVERING,
    RECOVERY_RETRY,
    SERVED,
    AllCooling,
    Exhausted,
    Final,
    RecoveryExhausted,
    Rejected,
    Rejection,
    RouteDown,
    Served,
    Transient,
    Try,
    Wait,
    cools,
    own_refusal,
)
from codex_failover.core.planner import Candidate, make_plan
from codex_failover.core.pool_feedback import PoolFeedback
from codex_failover.core.recovery import RecoveryPolicy
from codex_failover.core.routes import RouteHealth, parse_routes
from codex_failover.core.usage import UsageBook
from codex_failover.core.vocabulary import (
    AMBIGUOUS,
    AUTH_REJECTED,
    HANDSHAKE_FAILED,
    HOST_NETWORK,
    INCOMPLETE_RESPONSE,
    PRE_DISPATCH,
    RESPONSE_TIMEOUT,
    ROUTE_DOWN,
    TLS_FAILED,
    UPGRADE_REFUSED,
)

CLIENT_AUTH = AuthMaterial(APIKEY, "tok-client")
ROUTES = {"corp": ["http://p0:3128", "http://p1:3128"]}
WAITS = {BACKOFF: "backoff", PROBING: "probing", RECOVERING: "recovering", RECOVERY_RETRY: "retry"}


def cred(name: str, route: str = "direct") -> Credential:
    return Credential(name, AuthMaterial(APIKEY, f"tok-{name}"), "https://api.example/v1", "$X", route=route)


def rej(reason: str, status: int | None = 503, message: str = "", retry_after: str | None = None, **error) -> Rejected:
    return Rejected(Rejection(reason, status, {"message": message or reason, **error}, retry_after=retry_after))


def transient(why: str = "no_terminal_event", final: object = None) -> Transient:
    return Transient(why, final)


class World:
    """The pool, its health and its routes' health, all on one injected clock."""

    def __init__(self, creds=(), routes=None, use_client=False, movable=True, recovery=None, **policy):
        self.clock = Clock()
        self.health = Health(self.clock)
        self.route_health = RouteHealth(floor=30, cap=300, clock=self.clock)
        # The loop's cases are written against a fixed overload cooldown and no share held out
        # (the cooldown policy has its own tests: test_cooldown_policy.py).
        fixed = policy.get("overload_cooldown", 60.0)
        policy.setdefault("overload", OverloadPolicy(first=fixed, factor=1.0, max=max(fixed, 1.0), max_held_out=1.0))
        self.pool = PoolConfig(tuple(creds), Policy(use_client_credential=use_client, **policy),
                               routes=parse_routes(routes), recovery=recovery or RecoveryPolicy())
        self.movable = movable
        self.feedback = PoolFeedback(self.health, Affinity(clock=self.clock), UsageBook(), pool_size=len(creds) + use_client)
        self.told: list[str] = []

    def plan(self):
        return make_plan(CLIENT_AUTH, self.pool, self.health, self.movable)

    def loop(self, **kw) -> FailoverLoop:
        return FailoverLoop(self.plan, self.health, self.route_health, self.pool, clock=self.clock,
                            rand=lambda: 0.5, tell=lambda level, text: self.told.append(text), **kw)

    def key(self, name: str) -> str:
        plan = self.plan()
        return next(c.key for c in [*plan.candidates, *(c for c, _ in plan.skipped)] if c.name == name)

    def cool(self, name: str, seconds: float, reason: str = "overloaded") -> None:
        self.health.cool(self.key(name), seconds, reason)

    def endpoint(self, index: int):
        return self.pool.routes["corp"][index]

    def states(self) -> dict[str, str]:
        plan = self.plan()
        return {c.name: self.health.state(c.key).status for c in [*plan.candidates, *(c for c, _ in plan.skipped)]}


def pooled(w: World) -> None:
    """The share held out for overload counts the pooled credentials only (mitm/addon.py's feedback)."""
    w.feedback.pool_keys = frozenset(w.key(c.name) for c in w.pool.credentials)
    w.feedback.pool_size = len(w.pool.credentials)


def overloaded(w: World, name: str, seconds: float) -> None:
    """`name` overloaded now (its streak's last failure) and resting `seconds`; the clock moves on 1 s."""
    w.health.streaks.overloaded(w.key(name), w.clock.now, w.pool.policy.overload)
    w.cool(name, seconds)
    w.clock.now += 1


def show(step) -> str:
    match step:
        case Try(cand, ep, n):
            return f"try {where(cand, ep)} #{n}"
        case Wait(seconds, why):
            return f"wait {seconds:g}s ({WAITS[why]})"
        case RouteDown(cand, _):
            return f"route down {cand.name}"
        case Exhausted(last, retry_after):
            return f"exhausted: {last.reason}, retry-after {retry_after}"
        case AllCooling(states, retry_after):
            return f"all cooling ({'; '.join(' '.join(map(str, s)) for s in states)}), retry-after {retry_after}"
        case Final(rejection):
            return f"final: {rejection.reason}"
        case RecoveryExhausted(cand, why, _):
            return f"recovery exhausted on {cand.name}: {why}"
    raise AssertionError(f"not a decision: {step!r}")


def where(cand: Candidate, ep) -> str:
    return cand.name if ep is None else f"{cand.name}@{ep.route}[{ep.index}]"


def drive(world: World, loop: FailoverLoop, script: dict[str, list]) -> tuple[list[str], object]:
    """Ask and report until the loop ends (or an attempt serves), as a shell does. Returns the
    transcript and the last decision (SERVED when an attempt served)."""
    script = {k: list(v) for k, v in script.items()}
    steps: list[str] = []
    for _ in range(50):
        step = loop.next()
        steps.append(show(step))
        match step:
            case Try(cand, ep, _):
                results = script.get(where(cand, ep))
                assert results, f"the loop tried {where(cand, ep)}, which the script has no (more) results for: {steps}"
                result = results.pop(0)
                stands = loop.report(result)
                if isinstance(result, Rejected) and stands and cools(cand, result.rejection):
                    r = result.rejection
                    world.feedback.rejected(cand.key, cand.name, r.reason, r.status, r.error, r.retry_after,
                                            world.pool.policy)
                if isinstance(result, Served):
                    return steps, SERVED
            case Wait(seconds, _):
                world.clock.now += seconds
            case RouteDown():
                pass
            case _:
                return steps, step
    raise AssertionError(f"the loop did not end: {steps}")


@dataclass
class Case:
    id: str
    script: dict[str, list]
    want: list[str]
    world: dict = field(default_factory=dict)  # World(...) arguments
    before: object = None  # World -> None: cool credentials, back endpoints off
    loop: dict = field(default_factory=dict)  # FailoverLoop(...) arguments
    states: dict | None = None  # credential name -> health status after the run
    told: tuple[str, ...] = ()  # log lines the loop told, each a substring of one of them


POOL = {"creds": [cred("a"), cred("b")]}
ROUTED = {"creds": [cred("a", "corp"), cred("b")], "routes": ROUTES}
ALONE = {"creds": [], "use_client": True}  # no pool: the client's own credential is the only one
# The client's own key and one pooled credential, with the default share held out for overload (25 %;
# the other cases let the whole pool rest). `pooled` makes the share count the pool's only, as the addon does.
OWN_SPARE = {"creds": [cred("a")], "use_client": True,
             "overload": OverloadPolicy(first=60.0, factor=1.0, max=60.0, max_held_out=0.25)}
RECOVERY = RecoveryPolicy(enabled=True, attempts=2, backoff_initial=0.25, backoff_max=2.0)

CASES = [
    # -- candidates in order --------------------------------------------------------------------
    Case("first candidate ready", {"a": [SERVED]}, ["try a #1"], POOL, states={"a": "ready", "b": "ready"}),
    Case("a rejection fails over to the next", {"a": [rej("overloaded")], "b": [SERVED]}, ["try a #1", "try b #2"],
         POOL, states={"a": "cooling", "b": "ready"}),
    Case("a pool credential's 401 fails over and takes it out", {"a": [rej(AUTH_REJECTED, 401)], "b": [SERVED]},
         ["try a #1", "try b #2"], POOL, states={"a": "out", "b": "ready"}),
    Case("the client's own 401 is final: never failed over, nothing cools",
         {"client": [rej(AUTH_REJECTED, 401)]}, ["try client #1", "final: auth_rejected"],
         {"creds": [cred("a")], "use_client": True}, states={"client": "ready", "a": "ready"}),
    Case("max_attempts bounds the attempts", {n: [rej("overloaded")] for n in "abc"},
         ["try a #1", "try b #2", "exhausted: overloaded, retry-after 1"],  # c is ready: Retry-After 1
         {"creds": [cred("a"), cred("b"), cred("c")], "max_attempts": 2}),
    Case("every credential rejected: exhausted with the last rejection",
         {"a": [rej("overloaded")], "b": [rej("usage_limit", 429)]},
         ["try a #1", "try b #2", "exhausted: usage_limit, retry-after None"], POOL),
    # -- the only credential --------------------------------------------------------------------
    Case("the only credential is retried after 0.5 s", {"client": [rej("overloaded"), SERVED]},
         ["try client #1", "wait 0.5s (backoff)", "try client #2"], ALONE),
    Case("the only credential backs off 0.5/1/2/4 s, then exhausted by max_attempts",
         {"client": [rej("overloaded")] * 5},
         ["try client #1", "wait 0.5s (backoff)", "try client #2", "wait 1s (backoff)", "try client #3",
          "wait 2s (backoff)", "try client #4", "wait 4s (backoff)", "try client #5",
          "exhausted: overloaded, retry-after None"],
         {**ALONE, "max_attempts": 5, "cooldown_wait": 10.0}),
    Case("the only credential: upstream's Retry-After lengthens the backoff",
         {"client": [rej("overloaded", retry_after="1.5"), SERVED]},
         ["try client #1", "wait 1.5s (backoff)", "try client #2"], ALONE),
    Case("the only credential: resets_in_seconds lengthens the backoff",
         {"client": [rej("slow_down", resets_in_seconds=1.25), SERVED]},
         ["try client #1", "wait 1.25s (backoff)", "try client #2"], ALONE),
    Case("the only credential: a backoff past cooldown_wait ends it",
         {"client": [rej("overloaded")] * 4},
         ["try client #1", "wait 0.5s (backoff)", "try client #2", "wait 1s (backoff)", "try client #3",
          "wait 2s (backoff)", "try client #4", "exhausted: overloaded, retry-after None"],
         {**ALONE, "max_attempts": 5}),
    Case("the only credential: a hint past cooldown_wait ends it at once",
         {"client": [rej("overloaded", retry_after="30")]},
         ["try client #1", "exhausted: overloaded, retry-after None"], ALONE),
    Case("the only credential: a rejection not worth retrying ends it at once",
         {"client": [rej("rate_limited", 429)]}, ["try client #1", "exhausted: rate_limited, retry-after None"], ALONE),
    Case("a pinned request's own credential is the only one",
         {"client": [rej("overloaded"), SERVED]}, ["try client #1", "wait 0.5s (backoff)", "try client #2"],
         {"creds": [cred("a")], "use_client": True, "movable": False}),
    # -- cooling credentials --------------------------------------------------------------------
    Case("all cooling: nothing dialled, Retry-After the soonest recovery",
         {}, ["all cooling (a cooling overloaded; b cooling usage_limit_window), retry-after 10"],
         {**POOL, "max_retry_after": 60.0},
         before=lambda w: (w.cool("a", 30), w.cool("b", 10, "usage_limit_window"))),
    Case("all cooling: no Retry-After when the first back is later than max_retry_after (a promise nobody keeps)",
         {}, ["all cooling (a cooling overloaded; b cooling overloaded), retry-after None"], POOL,
         before=lambda w: (w.cool("a", 30), w.cool("b", 10))),
    Case("all cooling: Retry-After when the first back is within max_retry_after",
         {}, ["all cooling (a cooling overloaded; b cooling overloaded), retry-after 4"], POOL,
         before=lambda w: (w.cool("a", 30), w.cool("b", 3.2))),
    Case("all cooling: no Retry-After when max_retry_after is 0",
         {}, ["all cooling (a cooling overloaded; b out HTTP 401 from upstream), retry-after None"],
         {**POOL, "max_retry_after": 0.0},
         before=lambda w: (w.cool("a", 30), w.health.take_out(w.key("b"), "HTTP 401 from upstream"))),
    Case("nothing ready: holds for the first that recovers within cooldown_wait, then tries it",
         {"a": [SERVED]}, ["wait 1s (recovering)", "try a #1"], POOL,
         before=lambda w: (w.cool("a", 1), w.cool("b", 30)),
         told=("no credential ready; holding 1.0s for the first to recover",)),
    Case("after a rejection: holds for an untried one that recovers within cooldown_wait",
         {"a": [rej("overloaded")], "b": [SERVED]}, ["try a #1", "wait 1.5s (recovering)", "try b #2"], POOL,
         before=lambda w: w.cool("b", 1.5), told=("holding 1.5s for the first to recover",)),
    Case("a cooling credential past cooldown_wait: exhausted after the rejection",
         {"a": [rej("overloaded")]}, ["try a #1", "exhausted: overloaded, retry-after None"], POOL,
         before=lambda w: w.cool("b", 30)),
    # -- route endpoints ------------------------------------------------------------------------
    Case("an endpoint backing off is skipped: the next endpoint", {"a@corp[1]": [SERVED]}, ["try a@corp[1] #1"],
         ROUTED, before=lambda w: w.route_health.failed(w.endpoint(0), "refused")),
    Case("pre-dispatch on an endpoint: the next endpoint, without costing an attempt",
         {"a@corp[0]": [rej(PRE_DISPATCH, message="connection refused")], "a@corp[1]": [SERVED]},
         ["try a@corp[0] #1", "try a@corp[1] #1"], ROUTED, states={"a": "ready", "b": "ready"},
         told=("corp[0] http://p0:3128 failed before dispatch (connection refused); not dialled again for 30s",)),
    Case("every endpoint down: route_down, the credential not penalised, the next credential",
         {"a@corp[0]": [rej(PRE_DISPATCH)], "a@corp[1]": [rej(PRE_DISPATCH)], "b": [SERVED]},
         ["try a@corp[0] #1", "try a@corp[1] #1", "route down a", "try b #2"], ROUTED,
         states={"a": "ready", "b": "ready"}),
    Case("the only credential's route down: exhausted with route_down (502), not retried, no Retry-After (a is not cooling: no promise)",
         {"a@corp[0]": [rej(PRE_DISPATCH)], "a@corp[1]": [rej(PRE_DISPATCH)]},
         ["try a@corp[0] #1", "try a@corp[1] #1", "route down a", "exhausted: route_down, retry-after None"],
         {"creds": [cred("a", "corp")], "routes": ROUTES}, states={"a": "ready"}),
    Case("no endpoint may be dialled: route down without an attempt on it",
         {"b": [SERVED]}, ["route down a", "try b #2"], ROUTED,
         before=lambda w: [w.route_health.failed(w.endpoint(i), "refused") for i in (0, 1)]),
    Case("host-wide network loss: not the route's fault nor the credential's; the next credential",
         {"a@corp[0]": [rej(HOST_NETWORK, 502)], "b": [SERVED]}, ["try a@corp[0] #1", "try b #2"], ROUTED,
         states={"a": "ready", "b": "ready"}),
    Case("a rejection through an endpoint stands: the next credential, not the next endpoint",
         {"a@corp[0]": [rej("overloaded")], "b": [SERVED]}, ["try a@corp[0] #1", "try b #2"], ROUTED,
         states={"a": "cooling", "b": "ready"}),
    # -- failures that must not move ------------------------------------------------------------
    Case("a TLS verification failure fails closed", {"a@corp[0]": [rej(TLS_FAILED, None)]},
         ["try a@corp[0] #1", "final: tls_failed"], ROUTED, states={"a": "ready", "b": "ready"}),
    Case("an ambiguous failure (the request may have left) is never replayed", {"a": [rej(AMBIGUOUS, None)]},
         ["try a #1", "final: ambiguous"], POOL),
    Case("no response within response_timeout is never replayed", {"a": [rej(RESPONSE_TIMEOUT, None)]},
         ["try a #1", "final: response_timeout"], POOL),
    Case("an incomplete response is never replayed", {"a": [rej(INCOMPLETE_RESPONSE, None)]},
         ["try a #1", "final: incomplete_response"], POOL),
    # -- recovery (same credential, same endpoint) ----------------------------------------------
    Case("recovery retries the same credential with full-jitter backoff",
         {"a": [transient(), transient(), SERVED]},
         ["try a #1", "wait 0.125s (retry)", "try a #1", "wait 0.25s (retry)", "try a #1"],
         {**POOL, "recovery": RECOVERY},
         told=("recovery: no_terminal_event on credential a; retry 1 in 125 ms",
               "recovery: no_terminal_event on credential a; retry 2 in 250 ms")),
    Case("recovery's attempts run out: recovery exhausted",
         {"a": [transient()] * 3},
         ["try a #1", "wait 0.125s (retry)", "try a #1", "wait 0.25s (retry)", "try a #1",
          "recovery exhausted on a: no_terminal_event"], {**POOL, "recovery": RECOVERY},
         told=("recovery exhausted on credential a: no_terminal_event",)),
    Case("recovery's window closes: recovery exhausted",
         {"a": [transient("HTTP 503")] * 3},
         ["try a #1", "wait 0.5s (retry)", "try a #1", "recovery exhausted on a: HTTP 503"],
         {**POOL, "recovery": RecoveryPolicy(enabled=True, retry_window=1.0, backoff_initial=1.0, backoff_max=2.0)}),
    Case("recovery retries stay on the endpoint",
         {"a@corp[0]": [transient(), SERVED]}, ["try a@corp[0] #1", "wait 0.125s (retry)", "try a@corp[0] #1"],
         {**ROUTED, "recovery": RECOVERY}),
    Case("a retry that fails before dispatch moves to the next endpoint",
         {"a@corp[0]": [transient(), rej(PRE_DISPATCH)], "a@corp[1]": [SERVED]},
         ["try a@corp[0] #1", "wait 0.125s (retry)", "try a@corp[0] #1", "try a@corp[1] #1"],
         {**ROUTED, "recovery": RECOVERY}),
    Case("a rejection after a retry fails over as usual",
         {"a": [transient(), rej("overloaded")], "b": [SERVED]},
         ["try a #1", "wait 0.125s (retry)", "try a #1", "try b #2"], {**POOL, "recovery": RECOVERY}),
    # -- a WebSocket handshake ------------------------------------------------------------------
    Case("a handshake never waits: the only credential's overload ends it",
         {"client": [rej("overloaded")]}, ["try client #1", "exhausted: overloaded, retry-after None"], ALONE,
         loop={"handshake": True}),
    Case("a handshake never holds for a cooling credential",
         {"a": [rej("overloaded")]}, ["try a #1", "exhausted: overloaded, retry-after 1"], POOL,
         before=lambda w: w.cool("b", 1), loop={"handshake": True}),
    Case("a refused upgrade and a failed handshake move on and cool nothing",
         {"a": [rej(UPGRADE_REFUSED, 404)], "b": [rej(HANDSHAKE_FAILED, None)], "c": [SERVED]},
         ["try a #1", "try b #2", "try c #3"], {"creds": [cred("a"), cred("b"), cred("c")]},
         loop={"handshake": True}, states={"a": "ready", "b": "ready", "c": "ready"}),
    Case("an overloaded upgrade cools its credential and moves on",
         {"a": [rej("overloaded")], "b": [SERVED]}, ["try a #1", "try b #2"], POOL, loop={"handshake": True},
         states={"a": "cooling", "b": "ready"}),
    Case("a handshake's ambiguous failure moves on (no conversation was sent) and cools, as it did",
         {"a": [rej(AMBIGUOUS, None)], "b": [SERVED]}, ["try a #1", "try b #2"], POOL, loop={"handshake": True},
         states={"a": "cooling", "b": "ready"}),
    Case("a handshake's TLS failure fails closed", {"a": [rej(TLS_FAILED, None)]}, ["try a #1", "final: tls_failed"],
         POOL, loop={"handshake": True}, states={"a": "ready", "b": "ready"}),
    Case("the client's own refused upgrade is final (Codex gets it on SSE)",
         {"client": [rej(AUTH_REJECTED, 403)]}, ["try client #1", "final: auth_rejected"],
         {"creds": [cred("a")], "use_client": True}, loop={"handshake": True}, states={"client": "ready", "a": "ready"}),
    Case("a turn goes on from the credential its socket used", {"b": [SERVED]}, ["try b #2"], POOL,
         loop={"handshake": True, "tried": ("a",), "n": 1}),
    Case("a turn at max_attempts opens nothing", {}, ["all cooling (), retry-after 1"], POOL,
         loop={"handshake": True, "tried": ("a",), "n": 4}),
    # -- a gated turn waits as HTTP does (handshake rules, HTTP's waits) ---------------------------
    Case("a turn rejected on the only credential: a new socket there after 0.5 s, 1 s, 2 s",
         {"client": [SERVED]}, ["wait 0.5s (backoff)", "try client #2"], ALONE,
         lambda w: w.cool("client", 15),
         loop={"handshake": True, "waits": True, "tried": ("client",), "n": 1,
               "last": Rejection("overloaded", 503, {"message": "busy"})}),
    Case("a turn whose backoff is spent opens nothing (the gate closes for a reconnect)", {},
         ["exhausted: overloaded, retry-after None"], ALONE, lambda w: w.cool("client", 15),
         loop={"handshake": True, "waits": True, "tried": ("client",), "n": 4,
               "last": Rejection("overloaded", 503, {"message": "busy"})}),
    Case("a turn holds for a credential back within cooldown_wait", {"b": [SERVED]},
         ["wait 1s (recovering)", "try b #2"], POOL, lambda w: w.cool("b", 1),
         loop={"handshake": True, "waits": True, "tried": ("a",), "n": 1}),
    Case("the upgrade itself never waits", {}, ["all cooling (b cooling overloaded), retry-after 1"], POOL,
         lambda w: w.cool("b", 1), loop={"handshake": True, "tried": ("a",), "n": 1}),
    # -- the only credential resting for an overload is probed, not refused undialled ------------------
    Case("a pinned request whose credential rests for an overload: probed after 0.5 s", {"a": [SERVED]},
         ["wait 0.5s (backoff)", "try a #1"], {"creds": [cred("a")]}, lambda w: w.cool("a", 15),
         told=("probing it in 0.5s",)),
    Case("a failed probe ends it: the rest was right (no backoff after it)", {"a": [rej("overloaded")]},
         ["wait 0.5s (backoff)", "try a #1", "exhausted: overloaded, retry-after None"], {"creds": [cred("a")]},
         lambda w: w.cool("a", 15)),
    Case("a usage limit is a fact: never probed", {}, ["all cooling (a cooling usage_limit), retry-after None"],
         {"creds": [cred("a")]}, lambda w: w.cool("a", 600, "usage_limit")),
    # -- every credential resting for an overload: the least recently failed is probed once ---------
    # (the client's own plus one spare: the share held out counts the pool's only, so nothing brings one back)
    Case("the client's own plus a spare, both resting for an overload: the least recently failed is probed once",
         {"client": [SERVED]}, ["wait 0.5s (probing)", "try client #1"], OWN_SPARE,
         lambda w: (pooled(w), overloaded(w, "client", 15), overloaded(w, "a", 15)),
         told=("no credential ready; probing client in 0.5s (resting for an overload, the least recently failed)",)),
    Case("the least recently failed, whichever it is", {"a": [SERVED]}, ["wait 0.5s (probing)", "try a #1"], OWN_SPARE,
         lambda w: (pooled(w), overloaded(w, "a", 15), overloaded(w, "client", 15))),
    Case("a failed probe ends it: one probe a request", {"client": [rej("overloaded")]},
         ["wait 0.5s (probing)", "try client #1", "exhausted: overloaded, retry-after None"], OWN_SPARE,
         lambda w: (pooled(w), overloaded(w, "client", 15), overloaded(w, "a", 15))),
    Case("after a rejection, the untried one resting for an overload is probed", {"client": [rej("overloaded")], "a": [SERVED]},
         ["try client #1", "wait 0.5s (probing)", "try a #2"], OWN_SPARE, lambda w: (pooled(w), overloaded(w, "a", 15))),
    Case("only the overload rests are probed: a usage limit is a fact", {"a": [SERVED]},
         ["wait 0.5s (probing)", "try a #1"], OWN_SPARE,
         lambda w: (pooled(w), w.cool("client", 600, "usage_limit"), overloaded(w, "a", 15))),
    Case("one back within cooldown_wait is held for, not the least recently failed probed", {"a": [SERVED]},
         ["wait 0.5s (recovering)", "try a #1"], OWN_SPARE,
         lambda w: (pooled(w), overloaded(w, "client", 15), overloaded(w, "a", 1.5))),
    Case("a handshake never probes", {},
         ["all cooling (client cooling overloaded; a cooling overloaded), retry-after None"], OWN_SPARE,
         lambda w: (pooled(w), overloaded(w, "client", 15), overloaded(w, "a", 15)), loop={"handshake": True}),
    Case("the whole pool may rest (max_held_out 100%): no probe while another credential is in the plan", {},
         ["all cooling (a cooling overloaded; b cooling overloaded), retry-after None"], POOL,
         lambda w: (w.cool("a", 15), w.cool("b", 15))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decisions(case: Case):
    world = World(**case.world)
    if case.before is not None:
        case.before(world)
    loop = world.loop(**case.loop)
    steps, _ = drive(world, loop, case.script)
    assert steps == case.want, "decisions differ from today's"
    if case.states is not None:
        assert world.states() == case.states, "credential health after the run"
    for line in case.told:
        assert any(line in told for told in world.told), f"not told {line!r}; told: {world.told}"


# -- details the transcripts do not show ---------------------------------------------------

def test_total_is_max_attempts_for_the_only_credential_else_the_plans_size():
    assert World(**ALONE, max_attempts=6).loop().total == 6, "the only credential: max_attempts"
    assert World(**POOL, max_attempts=6).loop().total == 2, "a pool: its size"
    assert World(creds=[cred(n) for n in "abcde"], max_attempts=3).loop().total == 3, "a pool: at most max_attempts"


def test_route_down_names_each_endpoint_and_what_failed():
    world = World(**ROUTED)
    loop = world.loop()
    steps, last = drive(world, loop, {"a@corp[0]": [rej(PRE_DISPATCH, message="connection refused")],
                                      "a@corp[1]": [rej(PRE_DISPATCH, message="timed out connecting after 10s")],
                                      "b": [SERVED]})
    down = loop.last  # the route_down stays the last rejection until another comes
    assert down.reason == ROUTE_DOWN, steps
    assert down.status == 502
    assert down.error["message"] == ("route corp: no endpoint could be used (corp[0] http://p0:3128: connection "
                                     "refused; corp[1] http://p1:3128: timed out connecting after 10s)")


def test_a_handshake_words_a_failed_endpoint_with_its_backoff():
    """As the WebSocket dialer did (its 426 and history name the backoff too); HTTP names the failure."""
    world = World(**ROUTED)
    loop = world.loop(handshake=True)
    steps, _ = drive(world, loop, {"a@corp[0]": [rej(PRE_DISPATCH, message="refused")],
                                   "a@corp[1]": [rej(PRE_DISPATCH, message="refused")], "b": [SERVED]})
    assert "route down a" in steps, steps
    assert loop.last.error["message"] == (
        "route corp: no endpoint could be used (corp[0] http://p0:3128: backing off 30s more (failed 1x: refused); "
        "corp[1] http://p1:3128: backing off 30s more (failed 1x: refused))")


def test_report_says_whether_the_result_stands_against_the_credential():
    world = World(**ROUTED)
    loop = world.loop()
    assert isinstance(loop.next(), Try)
    assert loop.report(rej(PRE_DISPATCH)) is False, "a pre-dispatch failure on an endpoint is the endpoint's"
    assert isinstance(loop.next(), Try)
    assert loop.report(rej("overloaded")) is True, "a rejection through an endpoint is the credential's"
    assert isinstance(loop.next(), Try)
    assert loop.report(rej(PRE_DISPATCH)) is True, "direct, a pre-dispatch failure is the candidate's"


def test_endpoint_health_after_each_kind_of_result():
    cases = [(SERVED, "up"), (rej("overloaded"), "up"), (rej(TLS_FAILED, None), "up"),
             (rej(PRE_DISPATCH, message="refused"), "backing off 30s more (failed 1x: refused)")]
    for result, want in cases:
        world = World(**ROUTED)
        loop = world.loop()
        step = loop.next()
        assert step.endpoint == world.endpoint(0), show(step)
        loop.report(result)
        assert world.route_health.describe(world.endpoint(0)) == want, f"after {result}"


def test_host_network_releases_a_probe_without_a_verdict():
    world = World(**ROUTED)
    ep = world.endpoint(0)
    world.route_health.failed(ep, "refused")
    world.clock.now += 30  # due for a probe
    loop = world.loop()
    step = loop.next()
    assert step.endpoint == ep, f"the probe goes to the endpoint due for it: {show(step)}"
    loop.report(rej(HOST_NETWORK, 502))
    assert world.route_health.describe(ep) == "due for a probe (failed 1x: refused)", "released, not blamed, not cleared"


def test_abandon_releases_the_claimed_endpoint():
    world = World(**ROUTED)
    ep = world.endpoint(0)
    world.route_health.failed(ep, "refused")
    world.clock.now += 30
    loop = world.loop()
    assert loop.next().endpoint == ep
    assert "being probed" in world.route_health.describe(ep)
    loop.abandon()  # the client left mid-attempt
    assert world.route_health.describe(ep) == "due for a probe (failed 1x: refused)", "a probe that never finished"
    loop.abandon()  # twice is harmless
    assert world.route_health.claim(ep), "the next request may probe it"


def test_abandon_during_a_recovery_wait_releases_the_endpoint():
    world = World(**ROUTED, recovery=RECOVERY)
    ep = world.endpoint(0)
    world.route_health.failed(ep, "refused")
    world.clock.now += 30
    loop = world.loop()
    assert loop.next().endpoint == ep
    loop.report(transient())
    assert isinstance(loop.next(), Wait)
    loop.abandon()
    assert not world.route_health.describe(ep).startswith("being probed"), "still claimed after the client left"


def test_recovery_exhausted_hands_back_the_shells_final_answer():
    world = World(**POOL, recovery=RecoveryPolicy(enabled=True, attempts=1))
    loop = world.loop()
    loop.next()
    loop.report(transient("HTTP 503", final="the buffered 503"))
    assert isinstance(loop.next(), Wait)
    loop.next()
    loop.report(transient("HTTP 503", final="the last 503"))
    step = loop.next()
    assert isinstance(step, RecoveryExhausted), show(step)
    assert step.final == "the last 503", "the final attempt's answer"


def test_the_only_credential_is_retried_while_cooling():
    """Its own cooldown notwithstanding: the backoff is the retry's only pace."""
    world = World(**ALONE)
    loop = world.loop()
    loop.next()
    loop.report(rej("overloaded"))
    world.cool("client", 60)
    assert isinstance(loop.next(), Wait)
    step = loop.next()
    assert isinstance(step, Try), show(step)
    assert step.candidate.is_client


def test_exhausted_retry_after_is_the_soonest_recovery():
    world = World(creds=[cred("a"), cred("b")], max_retry_after=120.0, overload_cooldown=45.0)
    loop = world.loop()
    steps, last = drive(world, loop, {"a": [rej("overloaded")], "b": [rej("overloaded", retry_after="90")]})
    assert steps[-1] == "exhausted: overloaded, retry-after 45", "a recovers first, in 45 s"


@pytest.mark.parametrize("reason, is_client, want", [
    ("overloaded", False, True),
    ("overloaded", True, True),
    ("usage_limit", False, True),
    (AUTH_REJECTED, False, True),  # a pool credential's 401/403: taken out
    (AUTH_REJECTED, True, False),  # the client's own: its own answer
    (ROUTE_DOWN, False, False),
    (PRE_DISPATCH, False, False),
    (HOST_NETWORK, False, False),
    (TLS_FAILED, False, False),
    (UPGRADE_REFUSED, False, False),
    (HANDSHAKE_FAILED, False, False),
    (AMBIGUOUS, False, True),  # as the WebSocket dialer did; on HTTP it ends the request before anything cools
])
def test_what_cools(reason, is_client, want):
    cand = Candidate("k", "k", None, None, is_client)
    assert cools(cand, Rejection(reason, None, {})) is want, f"{reason} on {'the client' if is_client else 'a spare'}"


def test_own_refusal_is_only_the_clients_401_or_403():
    client, spare = Candidate("c", "c", None, None, True), Candidate("k", "k", None, None, False)
    assert own_refusal(AUTH_REJECTED, client), "the client's own 401/403 is delivered as is"
    assert not own_refusal(AUTH_REJECTED, spare), "a pool credential's 401/403 fails over"
    assert not own_refusal("overloaded", client), "only a refusal"


# -- a probe among several: what may change while it waits, and requests that arrive together ---------

def own_spare_resting() -> World:
    """The client's own key and the spare `a`, both resting for an overload (the own failed first)."""
    world = World(**OWN_SPARE)
    pooled(world)
    overloaded(world, "client", 15)
    overloaded(world, "a", 15)
    return world


def test_requests_arriving_together_probe_one_credential_each_never_the_same_twice():
    world = own_spare_resting()
    loops = [world.loop() for _ in range(3)]
    steps = [show(loop.next()) for loop in loops]
    assert steps == ["wait 0.5s (probing)", "wait 0.5s (probing)", "all cooling (client cooling overloaded; a cooling "
                                                                    "overloaded), retry-after None"]
    world.clock.now += 0.5
    tries = [loops[0].next(), loops[1].next()]
    assert [t.candidate.name for t in tries] == ["client", "a"], "one probe at a time per credential"
    loops[0].report(SERVED)  # its claim ends with its result: the next request may probe it again
    assert world.health.probes.held(world.key("client"), world.clock.now) is False
    assert world.health.probes.held(world.key("a"), world.clock.now) is True


@pytest.mark.parametrize("meanwhile", ["taken out (a 401 to another request)", "at its usage limit"])
def test_a_probe_whose_credential_changed_while_it_waited_is_never_sent(meanwhile):
    world = own_spare_resting()
    loop = world.loop()
    assert show(loop.next()) == "wait 0.5s (probing)"
    if meanwhile.startswith("taken out"):
        world.health.take_out(world.key("client"), "HTTP 401 from upstream")
    else:
        world.health.cool(world.key("client"), 3600, "usage_limit")
    world.clock.now += 0.5
    step = loop.next()
    assert not isinstance(step, Try), show(step)
    assert world.health.probes.held(world.key("client"), world.clock.now) is False, "its claim released"


def test_a_credential_whose_token_expired_is_never_probed():
    world = World(**OWN_SPARE)
    a = world.pool.credentials[0]
    expiring = replace(a, auth=replace(a.auth, expires_at=world.clock.now + 3))
    world.pool = replace(world.pool, credentials=(expiring,))
    pooled(world)
    overloaded(world, "a", 15)  # the least recently failed, but its token ends meanwhile
    overloaded(world, "client", 15)
    world.clock.now += 5
    steps, _ = drive(world, world.loop(), {"client": [SERVED]})
    assert steps == ["wait 0.5s (probing)", "try client #1"], "the own key, never the expired token"


def test_a_credential_back_within_max_retry_after_keeps_its_retry_after_instead_of_a_probe():
    """The own key back in 3 s (past cooldown_wait, within max_retry_after): Codex is told to re-send
    then (and is served), rather than the own key probed early and its rest doubled."""
    world = World(**OWN_SPARE)
    pooled(world)
    overloaded(world, "client", 5)  # (the clock moves 1 s with each: back in 3 s)
    overloaded(world, "a", 30)
    steps, last = drive(world, world.loop(), {})
    assert isinstance(last, AllCooling) and last.retry_after == 3, steps


def test_the_only_credential_is_not_probed_once_its_token_expired():
    """Expired is what the planner says first, whatever the credential's rest: an expired token is
    never sent to collect a 401, by a probe no more than by a plain attempt."""
    world = World(creds=[cred("a")])
    a = world.pool.credentials[0]
    world.pool = replace(world.pool, credentials=(replace(a, auth=replace(a.auth, expires_at=world.clock.now + 1)),))
    world.cool("a", 15)
    world.clock.now += 2
    steps, _ = drive(world, world.loop(), {})
    assert steps == ["all cooling (a expired overloaded), retry-after None"], steps
