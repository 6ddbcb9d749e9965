"""What the failover loop and its shells say to each other (core/failover_loop.py): what an attempt
came to (`Served`, `Rejected`, `Transient`, with its `Rejection`), each step the loop asks for
(`Try`, `Wait`, `RouteDown`, and the answers `Exhausted`, `AllCooling`, `Final`,
`RecoveryExhausted`), and the two rules every transport asks about a rejection (`own_refusal`,
`cools`). Plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .planner import Candidate
from .pool_wait import Soonest
from .routes import Endpoint
from .vocabulary import (
    AUTH_REJECTED,
    EDGE_BLOCKED,
    FORBIDDEN_PAGE,
    HANDSHAKE_FAILED,
    HOST_NETWORK,
    MODEL_NOT_ENTITLED,
    NOT_PROCESSED,
    PRE_DISPATCH,
    ROUTE_DOWN,
    STATE_LOST,
    TLS_FAILED,
    UPGRADE_REFUSED,
)

# Failures that say nothing about the credential: they never cool it.
# Nor do the edge's refusals (the route's), a socket that lost a turn's state, or a model the account's plan
# lacks (remembered per credential and model instead: `learn`).
NOT_THE_CREDENTIAL = frozenset({UPGRADE_REFUSED, HANDSHAKE_FAILED, PRE_DISPATCH, HOST_NETWORK, TLS_FAILED, ROUTE_DOWN,
                                NOT_PROCESSED, EDGE_BLOCKED, FORBIDDEN_PAGE, STATE_LOST, MODEL_NOT_ENTITLED})

# Why a Wait.
BACKOFF = "backoff before retrying the only credential"
RECOVERING = "holding for a cooling credential to recover"
PROBING = "probing a credential resting for an overload"
RECOVERY_RETRY = "recovery: retrying the same credential and endpoint"


@dataclass(frozen=True)
class Rejection:
    """Why an attempt did not serve: a reason class, upstream's status and error object (or ours),
    upstream's own messages when the rejection came in-stream on a WebSocket, and its Retry-After."""

    reason: str
    status: int | None
    error: dict[str, Any]
    frames: tuple[tuple[bytes, bool], ...] = ()
    retry_after: str | None = None


# -- what the shell reports after a Try -----------------------------------------------------

@dataclass(frozen=True)
class Served:
    """The attempt served: committed, delivered as is, or (a handshake) its socket opened."""


SERVED = Served()


@dataclass(frozen=True)
class Rejected:
    """The attempt did not serve; the loop decides whether that moves on."""

    rejection: Rejection


@dataclass(frozen=True)
class Transient:
    """Recovery: a transient failure worth retrying on the same candidate and endpoint. `final` is
    the shell's answer should the retries run out (handed back, unread, in RecoveryExhausted)."""

    why: str
    final: object = None


Result = Union[Served, Rejected, Transient]


# -- what the loop answers to next() --------------------------------------------------------

@dataclass(frozen=True)
class Try:
    """Send attempt `n` on `candidate` through `endpoint` (None: direct), then report its result."""

    candidate: Candidate
    endpoint: Endpoint | None
    n: int


@dataclass(frozen=True)
class Wait:
    """Hold the client `seconds`, then ask again."""

    seconds: float
    why: str  # BACKOFF, RECOVERING, PROBING or RECOVERY_RETRY


@dataclass(frozen=True)
class RouteDown:
    """No endpoint of the candidate's route could be used; the credential is not penalised. The
    shell records it and asks again (it is also the `last` rejection from now on)."""

    candidate: Candidate
    rejection: Rejection


@dataclass(frozen=True)
class Exhausted:
    """Every attempt was rejected (or no more may be made): answer with the last rejection."""

    last: Rejection
    retry_after: int | None  # seconds, or None: no Retry-After
    soonest: Soonest | None = None  # the first of the request's credentials back, if any is cooling
    # The rejection whose upstream answer the client gets as it came (vocabulary.AS_IT_CAME: an edge's
    # 403, a model's 400/404), when that decided and nothing is cooling; None: answer with ours.
    as_it_came: Rejection | None = None


@dataclass(frozen=True)
class AllCooling:
    """Nothing was dialled: every credential is cooling, out of rotation or expired."""

    states: tuple[tuple[str, str, str | None], ...]  # (credential name, why skipped, health reason)
    retry_after: int | None
    soonest: Soonest | None = None


@dataclass(frozen=True)
class Final:
    """A failure that must not move to anything else: answer with it (TLS verification failed, the
    request may have reached upstream, or the client's own credential was refused)."""

    rejection: Rejection


@dataclass(frozen=True)
class RecoveryExhausted:
    """Recovery's retries ran out on `candidate`: answer with the final attempt (`final`, as reported)."""

    candidate: Candidate
    why: str
    final: object = None


LoopStep = Union[Try, Wait, RouteDown, Exhausted, AllCooling, Final, RecoveryExhausted]


def own_refusal(reason: str, candidate: Candidate) -> bool:
    """The client's own credential refused (401/403): that answer is the client's, never failed over
    (on HTTP it is delivered as is; a refused WebSocket upgrade sends Codex to SSE, where it gets it)."""
    return reason == AUTH_REJECTED and candidate.is_client


def cools(candidate: Candidate, rejection: Rejection) -> bool:
    """Does `rejection` cool (or take out) its credential? Not the client's own 401/403, and not a
    failure that says nothing about the credential (its route, the network, TLS, the upgrade)."""
    return not own_refusal(rejection.reason, candidate) and rejection.reason not in NOT_THE_CREDENTIAL
