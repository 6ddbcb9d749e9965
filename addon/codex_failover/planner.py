"""The attempt plan for one request: which credentials, in which order. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from .auth import AuthMaterial
from .config import Credential, PoolConfig
from .health import Health

CLIENT = "client"


@dataclass(frozen=True)
class Candidate:
    key: str  # health key
    name: str  # shown in logs, comments, status
    auth: AuthMaterial | None  # None: leave the client's own headers alone
    base_url: str | None  # None: keep the request's own URL
    is_client: bool


def client_key(auth: AuthMaterial | None) -> str:
    return f"{CLIENT}:{auth.fingerprint}" if auth else CLIENT


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Candidate, ...]
    skipped: tuple[tuple[Candidate, str], ...]  # (candidate, why), e.g. cooling / out of rotation

    @property
    def all_keys(self) -> tuple[str, ...]:
        return tuple(c.key for c in self.candidates) + tuple(c.key for c, _ in self.skipped)


def make_plan(client_auth: AuthMaterial | None, pool: PoolConfig, health: Health, movable: bool = True) -> Plan:
    """Candidates in policy order. A request that may not move gets only its own credential."""
    policy = pool.policy
    ordered: list[Candidate] = []
    pooled = {c.auth.fingerprint: c for c in pool.credentials}
    own = pooled.get(client_auth.fingerprint) if client_auth else None
    client = _as_candidate(own, is_client=True) if own else Candidate(
        client_key(client_auth), CLIENT, None, None, True
    )
    if policy.use_client_credential or not pool.credentials or not movable:
        ordered.append(client)
    kind = client_auth.kind if client_auth else None
    for cred in pool.credentials if movable else ():
        if cred is own or (kind and cred.kind != kind and not policy.cross_kind):
            continue
        ordered.append(_as_candidate(cred, is_client=False))
    ready, skipped = [], []
    for cand in ordered:
        state = health.state(cand.key)
        if state.status == "ready":
            ready.append(cand)
        else:
            skipped.append((cand, state.status))
    return Plan(tuple(ready[: policy.max_attempts]), tuple(skipped))


def _as_candidate(cred: Credential, is_client: bool) -> Candidate:
    # The client's own credential when it is also pooled keeps the request's URL and headers.
    if is_client:
        return Candidate(cred.name, cred.name, None, None, True)
    return Candidate(cred.name, cred.name, cred.auth, cred.base_url, False)
