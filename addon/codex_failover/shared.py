"""What every held request and every gated WebSocket shares with the addon, as one object.

The addon builds one per request or socket from its current state (`FailoverAddon.shared()`), so a
request keeps the pool and rules it started with when the pool file changes under it; everything
else (health, route health, affinity, usage, the kept connections) is the same live object for all.
No part creates private state of its own.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import PoolConfig
from .core.activity import Activity
from .core.affinity import Affinity
from .core.client_boundary import RejectedKeys
from .core.health import Health
from .core.pool_feedback import PoolFeedback
from .core.provenance import Provenance
from .core.recovery import Slots
from .core.routes import RouteHealth
from .core.rules import Rules
from .core.usage import UsageBook
from .metrics import Metrics
from .net.relay import Relay
from .net.socks_bridge import SocksBridges

if TYPE_CHECKING:
    from .mitm.engine import WarmConnections


@dataclass(frozen=True)
class Shared:
    pool: PoolConfig
    rules: Rules
    health: Health
    route_health: RouteHealth
    affinity: Affinity
    usage: UsageBook
    bridges: SocksBridges
    relay: Relay
    engine: "WarmConnections"  # the attempt engine (attempts over kept connections; tests inject a scripted one)
    attempts: dict  # attempt flow id -> Attempt, so the addon's hooks can find attempts
    notices: set  # one-time warnings already logged
    recovery_slots: Slots
    upstream_tls: ssl.SSLContext  # the gated WebSocket's upstream TLS (the system and certifi roots)
    metrics: Metrics | None = None  # Prometheus counters (failover_metrics), if on
    provenance: Provenance = field(default_factory=Provenance)  # which credential made which artifact
    rejected_keys: RejectedKeys | None = None  # client credentials the upstream refused (never lent the pool)
    activity: Activity | None = None  # the dashboard's recent requests and counts since start

    @property
    def feedback(self) -> PoolFeedback:
        names = frozenset(c.name for c in self.pool.credentials)
        return PoolFeedback(self.health, self.affinity, self.usage, self.rejected_keys, max(1, len(names)), names)
