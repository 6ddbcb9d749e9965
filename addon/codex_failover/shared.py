"""What every held request and every gated WebSocket shares with the addon, as one object.

The addon builds one per request or socket from its current state (`FailoverAddon.shared()`), so a
request keeps the pool and rules it started with when the pool file changes under it; everything
else (health, route health, affinity, usage, the kept connections) is the same live object for all.
No part creates private state of its own.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .affinity import Affinity
from .config import PoolConfig
from .health import Health
from .metrics import Metrics
from .outcomes import Outcomes
from .recovery import Slots
from .relay import Relay
from .routes import RouteHealth
from .rules import Rules
from .socks_bridge import SocksBridges
from .usage import UsageBook

if TYPE_CHECKING:
    from .warm_conn import WarmConnections


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
    upstream_tls: ssl.SSLContext | None  # the gated WebSocket's upstream TLS (the system and certifi roots)
    metrics: Metrics | None = None  # Prometheus counters (failover_metrics), if on

    @property
    def outcomes(self) -> Outcomes:
        return Outcomes(self.health, self.affinity, self.usage)
