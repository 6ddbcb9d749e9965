"""The pool and its failover policy as data: what `config.py` reads from the pool file.

Why here: the decisions in core/ take their policy as these values and never import the loader (or
YAML); `config.py` builds them from the pool file and re-exports them, so either name works.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .auth import AuthMaterial
from .cooldown_policy import OverloadPolicy
from .recovery import RecoveryPolicy


@dataclass(frozen=True)
class Policy:
    max_attempts: int = 4
    bootstrap_timeout: float = 30.0
    # Past bootstrap_timeout with nothing Codex would show, the hold goes on (a rejection may come
    # late) while the upstream is not silent this long (0: commit at bootstrap_timeout, as before)...
    first_event_timeout: float = 60.0
    max_hold: float = 300.0  # ...and at most this long in all (docs/decisions.md#a-hold-that-outlasts-a-slow-rejection)
    overload_cooldown: float = 60.0
    use_client_credential: bool = True
    max_retry_after: float = 5.0
    response_timeout: float = 120.0
    max_cooldown: float = 7 * 24 * 3600.0
    cross_kind: bool = False
    encrypted_reasoning: str = "strip"  # or "pin": see replay_safety.py
    cooldown_wait: float = 2.0  # hold a request this long at most for a cooling credential to recover
    selection: str = "fill-first"  # or "round-robin", among credentials of one priority
    session_idle: float = 3600.0  # a session's stickiness to a credential expires after this idle time
    max_sessions: int = 10000  # sessions remembered at most (least recently used forgotten first)
    connect_timeout: float = 10.0  # an attempt not connected (to its proxy or upstream) by then failed before dispatch
    route_backoff: float = 30.0  # first backoff of a dead route endpoint; doubles per failure
    route_backoff_max: float = 300.0  # the longest backoff
    overload: OverloadPolicy = OverloadPolicy()  # the pool file's `overload:` section (cooldown_policy.py)
    usage_recheck: float = 300.0  # a usage-limit cooldown is re-checked on the account's usage endpoint this often (0: never)


@dataclass(frozen=True)
class Credential:
    name: str
    auth: AuthMaterial
    base_url: str
    source: str  # where the secret came from (a path or an env var name), never the secret
    priority: int = 0  # lower is tried earlier
    auth_file: str | None = None  # re-read when it changes on disk
    route: str = "direct"  # the egress its attempts take
    organization: str | None = None  # sent as OpenAI-Organization on attempts moved to this credential
    project: str | None = None  # sent as OpenAI-Project likewise
    max_usage_percent: float = 100.0  # a rate-limit window this full counts as full: headroom for its owner

    def __post_init__(self) -> None:
        # The auth material carries them to `swap_credential`; re-applied whenever the material is
        # replaced (`dataclasses.replace(cred, auth=...)` after an auth file changed on disk).
        if (self.auth.organization, self.auth.project) != (self.organization, self.project):
            object.__setattr__(self, "auth", replace(self.auth, organization=self.organization, project=self.project))

    @property
    def kind(self) -> str:
        return self.auth.kind


@dataclass(frozen=True)
class Skipped:
    """A credential of the pool file whose auth file holds no usable credential now (missing, empty,
    logged out, unreadable): not in rotation, watched, and back once the file can be used."""

    name: str
    auth_file: str
    problem: str  # what is wrong, naming the file; never a secret

    def line(self, fix: str) -> str:
        return f"credential {self.name}: {self.problem}; skipped until it can be used ({fix})"


@dataclass(frozen=True)
class StateConfig:
    """Where pool state outlives the process (docs/state.md)."""

    store: str = "sqlite"  # sqlite (the default file), sqlite:///PATH, or memory
    namespace: str = "default"  # separates pools that share one store


@dataclass(frozen=True)
class PoolConfig:
    credentials: tuple[Credential, ...] = ()
    policy: Policy = field(default_factory=Policy)
    source: str | None = None
    base_urls: tuple[str, ...] = ()  # more model endpoints to gate (e.g. Codex's openai_base_url)
    routes: dict[str, Any] = field(default_factory=dict)  # route name -> tuple of Endpoint, or None (direct)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    notes: tuple[str, ...] = ()  # values clamped to their bounds, logged at load
    state: StateConfig = field(default_factory=lambda: StateConfig())
    skipped: tuple[Skipped, ...] = ()  # configured, but their auth file cannot be used now

    @property
    def gated_base_urls(self) -> tuple[str, ...]:
        return (*self.base_urls, *(c.base_url for c in self.credentials))
