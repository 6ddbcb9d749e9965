"""What the shell and an attempt's machine say to each other (core/attempt_machine.py): the events
the shell saw of the attempt, the commands it carries out, and the context every attempt of one
request shares. Plain data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

from .auth import AuthMaterial
from .policy import PoolConfig
from .pool_feedback import PoolFeedback
from .provenance import Provenance
from .recovery import Slots
from .rules import Rules
from .vocabulary import Reason, Verdict

# -- events: what the shell saw of the attempt ------------------------------------------------


@dataclass(frozen=True)
class Head:
    """The response head; `streaming`: an event stream to hold and classify."""

    status: int
    headers: Mapping[str, str]  # looked up case-insensitively by the shell's mapping
    streaming: bool


@dataclass(frozen=True)
class Chunk:
    data: bytes


@dataclass(frozen=True)
class End:
    """The body ended."""


@dataclass(frozen=True)
class Broke:
    """The connection failed or the upstream broke, with mitmproxy's words."""

    message: str


@dataclass(frozen=True)
class Tick:
    """`deadline` passed with nothing to read; `connected`: the attempt's connection is up."""

    connected: bool = True


@dataclass(frozen=True)
class Whole:
    """A response that is no event stream, read whole (decoded, bounded); None: it never completed."""

    content: bytes | None


Event = Union[Head, Chunk, End, Broke, Tick, Whole]

# -- commands: what the shell does, in order ---------------------------------------------------


@dataclass(frozen=True)
class ReadWhole:
    """Read the whole body by `deadline`, then feed `Whole`."""


@dataclass(frozen=True)
class Cancel:
    """Stop the attempt (its connection is not reused)."""


@dataclass(frozen=True)
class Commit:
    """The winner: `held` to the client now, then (unless `ended`, or `error` ends it) the live rest,
    each chunk also fed to `live()`; `first`: let the first output out before what follows."""

    held: bytes
    ended: bool = False
    error: str | None = None
    first: bool = True


@dataclass(frozen=True)
class Respond:
    """The attempt's whole response to the client, as it came (pooled secrets masked)."""


@dataclass(frozen=True)
class Succeeded:
    """The attempt served: tell the machine (`AttemptMachine.succeeded`), once the client's first
    output is out."""


@dataclass(frozen=True)
class Heartbeat:
    seconds: float


@dataclass(frozen=True)
class Record:
    """The attempt's row: its verdict on its flow, the history, a log line, the metrics."""

    verdict: Verdict
    reason: Reason
    status: int | None
    ok: bool = False


Command = Union[ReadWhole, Cancel, Commit, Respond, Succeeded, Heartbeat, Record]


@dataclass
class Scope:
    """What every attempt of one request shares: the policy and the core objects it teaches."""

    rules: Rules
    pool: PoolConfig
    feedback: PoolFeedback
    provenance: Provenance
    slots: Slots
    clock: Callable[[], float]
    compact: bool = False  # a /responses/compact request: its answer's artifacts are kept
    session: str | None = None  # affinity's key
    client_auth: AuthMaterial | None = None
    where: str = ""  # "[r1] ", for the pool's log lines
    tell: Callable[[int, str], None] = lambda level, text: None
    model: str | None = None  # the request's `model` (which credential lacks it: entitlement.py)


