"""mitm/client_limits.py's head timer: a client without a whole request head within
`failover_head_timeout` is dropped, unless the timer fired late because the proxy's own loop was held
up (then a head that arrived meanwhile is still unread: one more grace first)."""

from __future__ import annotations

import asyncio

from codex_failover.mitm import client_limits
from codex_failover.mitm.boundary import ClientBoundary
from codex_failover.mitm.client_limits import STALL, ClientLimits


def test_a_head_timer_that_fires_on_time_drops_the_client(monkeypatch):
    dropped: list[str] = []
    monkeypatch.setattr(client_limits.held_layer, "drop_client", lambda cid, why: dropped.append(cid) or True)

    async def go():
        limits = ClientLimits(ClientBoundary())
        limits._late("c1", asyncio.get_running_loop().time())
        assert dropped == ["c1"] and "c1" not in limits._timers

    asyncio.run(go())


def test_a_head_timer_that_fires_late_gives_one_more_grace_then_drops(monkeypatch):
    dropped: list[str] = []
    monkeypatch.setattr(client_limits.held_layer, "drop_client", lambda cid, why: dropped.append(cid) or True)

    async def go():
        limits = ClientLimits(ClientBoundary())
        loop = asyncio.get_running_loop()
        limits._late("c1", loop.time() - 5 * STALL)  # due 5 s ago: the loop was held up
        assert dropped == [] and "c1" in limits._timers  # what arrived meanwhile is read first
        limits._timers["c1"].cancel()
        limits._late("c1", None)  # the grace ran out: no head still
        assert dropped == ["c1"]

    asyncio.run(go())


def test_a_socket_not_found_when_it_connected_is_asked_again_at_its_request():
    """Under the uid rule, a loopback client whose socket the kernel did not report at connect time
    (a loaded machine) is not cached as another user's: its request asks again and is served as the
    user's own once found (and still not, while unknown)."""
    from types import SimpleNamespace

    from codex_failover.core import client_boundary as rules

    found: list[int | None] = [None]
    boundary = ClientBoundary(proxy_uid=1000)
    boundary.rule = rules.UID
    boundary.uid_of = lambda peer, local: found[0]  # type: ignore[method-assign]
    client = SimpleNamespace(id="c1", peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080))
    boundary.remember(client, None)  # the lookup at connect time found nothing
    assert boundary.is_own(client) is False  # still unknown at the request: not the user's own
    other = SimpleNamespace(id="c2", peername=("127.0.0.1", 40001), sockname=("127.0.0.1", 8080))
    boundary.remember(other, None)
    found[0] = 1000  # the kernel answers now
    assert boundary.is_own(other) is True
