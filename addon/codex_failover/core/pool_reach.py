"""Why the pool has nothing to offer a request at all (pool-only mode): the answer says that, not
"every credential is cooling". Pure."""

from __future__ import annotations

from .auth import CHATGPT, AuthMaterial
from .policy import PoolConfig

_KIND = {CHATGPT: "ChatGPT-login"}


def kind_name(kind: str) -> str:
    return _KIND.get(kind, "API-key")


def unreachable(client_auth: AuthMaterial | None, pool: PoolConfig, movable: bool) -> str | None:
    """With `use_client_credential: false`, a movable request whose kind no pooled credential (other
    than its own) serves, with `cross_kind` off: why, in words. None when the pool can offer one (even
    if it is cooling now), or when the request goes on its own credential anyway."""
    policy = pool.policy
    if policy.use_client_credential or not pool.credentials or not movable or client_auth is None:
        return None
    others = [c for c in pool.credentials if c.auth.account != client_auth.account]
    if any(c.kind == client_auth.kind or policy.cross_kind for c in others):
        return None
    wanted = kind_name(client_auth.kind)
    if not others:
        return (f"this {wanted} request's own credential is the pool's only one, and use_client_credential "
                "is false: nothing else can serve it")
    kinds = sorted({kind_name(c.kind) for c in others})
    return (f"no pooled credential serves {wanted} requests (the pool has only {' and '.join(kinds)} "
            f"credentials, cross_kind is off, and use_client_credential is false)")


def kind_gap(client_auth: AuthMaterial | None, pool: PoolConfig) -> str | None:
    """Why no pooled credential (other than the client's own) is offered to this client: every one is
    of the other kind and `cross_kind` is off. None when that is not the reason."""
    if client_auth is None or pool.policy.cross_kind:
        return None
    others = [c for c in pool.credentials if c.auth.account != client_auth.account]
    if not others or any(c.kind == client_auth.kind for c in others):
        return None
    kinds = " and ".join(sorted({kind_name(c.kind) for c in others}))
    return (f"the pool has only {kinds} credentials and this is a {kind_name(client_auth.kind)} request: "
            "set policy.cross_kind: true to lend them across kinds")


def kinds_at_start(pool: PoolConfig) -> str | None:
    """At load: a pool of one kind serves clients of that kind only (unless `cross_kind`)."""
    kinds = {c.kind for c in pool.credentials}
    if pool.policy.cross_kind or len(kinds) != 1:
        return None
    (kind,) = kinds
    other = "API-key" if kind == CHATGPT else "ChatGPT-login"
    return (f"every pooled credential is {kind_name(kind)}: a Codex on {other} gets no failover from the pool "
            "unless policy.cross_kind is true")
