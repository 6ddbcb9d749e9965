"""The attempt plan for one request: which credentials, in which order. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from .auth import AuthMaterial
from .health import Health
from .policy import Credential, Policy, PoolConfig

CLIENT = "client"
NOT_ENTITLED = "not_entitled"  # a plan's `lacking`: the credential's plan lacks the request's model (entitlement.py)


@dataclass(frozen=True)
class Candidate:
    key: str  # health key
    name: str  # shown in logs, comments, status
    auth: AuthMaterial | None  # None: leave the client's own headers alone
    base_url: str | None  # None: keep the request's own URL
    is_client: bool
    route: str = "direct"  # the egress route name
    full_at: float = 100.0  # usage percent at which a window counts as full (max_usage_percent)


def client_key(auth: AuthMaterial | None) -> str:
    return f"{CLIENT}:{auth.account}" if auth else CLIENT  # the account: a token refresh keeps it


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Candidate, ...]
    skipped: tuple[tuple[Candidate, str], ...]  # (candidate, why), e.g. cooling / out of rotation
    lacking: tuple[Candidate, ...] = ()  # ready, but known to lack the request's model: never waited for

    @property
    def all_keys(self) -> tuple[str, ...]:
        return tuple(c.key for c in self.candidates) + tuple(c.key for c, _ in self.skipped)


def make_plan(client_auth: AuthMaterial | None, pool: PoolConfig, health: Health, movable: bool = True,
              sticky: str | None = None, rotation: int = 0, bound: str | None = None, model: str | None = None) -> Plan:
    """Candidates in policy order: the session's sticky credential first, then the client's own
    (if `use_client_credential`), then the pool by priority (fill-first, or round-robin by
    `rotation` within a priority). A request that may not move gets only the credential holding
    its state (`bound`, by key), or its own when that is unknown or no longer in the pool. A movable
    request's credentials known to lack its `model` are `lacking`, not tried."""
    policy = pool.policy
    pooled = {c.auth.account: c for c in pool.credentials}  # by account: a refresh changes the token, not it
    own = pooled.get(client_auth.account) if client_auth else None
    client = _as_candidate(own, is_client=True) if own else Candidate(client_key(client_auth), CLIENT, None, None, True)
    if not movable:
        home = next((c for c in pool.credentials if c.name == bound and c is not own), None) if bound else None
        return _sorted_out([client if home is None else _as_candidate(home, is_client=False)], health, policy)
    ordered: list[Candidate] = []
    if policy.use_client_credential or not pool.credentials:
        ordered.append(client)
    if client_auth is not None:  # a request with no credential of its own never gets the pool's
        kind = client_auth.kind
        eligible = [c for c in pool.credentials if c is not own and (c.kind == kind or policy.cross_kind)]
        ordered += [_as_candidate(c, is_client=False) for c in _by_priority(eligible, policy.selection, rotation)]
        if sticky is not None:
            ordered.sort(key=lambda c: c.key != sticky)  # stable: only the sticky one moves up
    lacking = tuple(c for c in ordered if health.models.lacks(c.key, model))
    plan = _sorted_out([c for c in ordered if c not in lacking], health, policy)
    return Plan(plan.candidates, plan.skipped, lacking)


def _sorted_out(ordered: list[Candidate], health: Health, policy: Policy) -> Plan:
    """The candidates that can be tried now (at most `max_attempts`), and why the others cannot."""
    ready, skipped = [], []
    now = health.now()
    for cand in ordered:
        why = _unusable(cand, health, now)
        if why is None:
            ready.append(cand)
        else:
            skipped.append((cand, why))
    return Plan(tuple(ready[: policy.max_attempts]), tuple(skipped))


def _by_priority(creds: list[Credential], selection: str, rotation: int) -> list[Credential]:
    """Lower `priority` first; within one priority, config order (fill-first) or rotated."""
    out: list[Credential] = []
    for priority in sorted({c.priority for c in creds}):
        group = [c for c in creds if c.priority == priority]
        if selection == "round-robin" and group:
            shift = rotation % len(group)
            group = group[shift:] + group[:shift]
        out += group
    return out


def _unusable(cand: Candidate, health: Health, now: float) -> str | None:
    expires = cand.auth.expires_at if cand.auth is not None else None
    if expires is not None and expires <= now:  # (whatever its health says: no rest ends that)
        return "expired"  # never sent upstream to collect a 401; the user refreshes it with codex login
    state = health.state(cand.key)
    return None if state.status == "ready" else state.status


def _as_candidate(cred: Credential, is_client: bool) -> Candidate:
    # The client's own credential when it is also pooled keeps the request's URL and headers.
    if is_client:
        return Candidate(cred.name, cred.name, None, None, True, cred.route, cred.max_usage_percent)
    return Candidate(cred.name, cred.name, cred.auth, cred.base_url, False, cred.route, cred.max_usage_percent)
