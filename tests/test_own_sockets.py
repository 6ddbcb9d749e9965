"""core/own_sockets.py: a target is this proxy's own listener by address, never by spelling."""

from __future__ import annotations

import pytest

from codex_failover.core.own_sockets import address, end, is_own_listener, is_own_socket

PROXY = ("127.0.0.1", 8080)
ALL = ("0.0.0.0", 8080)
ALL6 = ("::", 8080)
METRICS = ("127.0.0.1", 9464)


@pytest.mark.parametrize("targets, port, listeners, local, own", [
    (["127.0.0.1"], 8080, [PROXY], (), True),
    (["127.0.0.1"], 8081, [PROXY], (), False),  # another port
    (["0.0.0.0"], 8080, [PROXY], (), True),  # a connection to 0.0.0.0 goes to loopback
    (["::ffff:127.0.0.1"], 8080, [PROXY], (), True),
    (["127.0.0.2"], 8080, [PROXY], (), False),  # bound to 127.0.0.1 only: 127.0.0.2 is not it
    (["127.0.0.2"], 8080, [ALL], (), True),  # every address, loopback among them
    (["192.0.2.7"], 8080, [ALL], ("192.0.2.7",), True),  # an address of this machine
    (["192.0.2.7"], 8080, [ALL], (), False),  # another machine's
    (["::1"], 8080, [ALL6], (), True),
    (["::"], 8080, [("::1", 8080)], (), True),
    (["93.184.216.34", "127.0.0.1"], 9464, [PROXY, METRICS], (), True),  # any resolved address counts
    (["not an ip"], 8080, [PROXY], (), False),
    ([], 8080, [PROXY], (), False),
])
def test_is_own_listener(targets, port, listeners, local, own):
    assert is_own_listener(targets, port, listeners, local) is own


def test_addresses_have_one_form():
    assert str(address("::ffff:127.0.0.1")) == "127.0.0.1"
    assert str(address("0.0.0.0")) == "127.0.0.1"
    assert str(address("fe80::1%eth0")) == "fe80::1"
    assert address("example.com") is None
    assert end(("::ffff:127.0.0.1", 5000, 0, 0)) == ("127.0.0.1", 5000)
    assert end(None) is None and end(("x",)) is None


# (client's far end, the proxy's end of it) -> is it the other end of one of the proxy's own sockets?
OWN = frozenset({(("127.0.0.1", 40000), ("127.0.0.1", 8080)),  # the proxy dialled its own listener
                 (("127.0.0.1", 40001), ("127.0.0.1", 443))})  # the proxy's connection to an upstream


@pytest.mark.parametrize("peer, local, own", [
    (("127.0.0.1", 40000), ("127.0.0.1", 8080), True),
    (("::ffff:127.0.0.1", 40000, 0, 0), ("::ffff:127.0.0.1", 8080, 0, 0), True),  # a dual-stack listener's view
    # Linux gives port 40001 to a Codex socket toward the proxy too (the upstream's socket goes elsewhere):
    # the same local end, another connection. Before, that client was taken for the proxy's own.
    (("127.0.0.1", 40001), ("127.0.0.1", 8080), False),
    (("127.0.0.1", 40002), ("127.0.0.1", 8080), False),
    (None, ("127.0.0.1", 8080), False),
    (("127.0.0.1", 40000), None, False),
])
def test_a_client_is_the_proxys_own_socket_only_when_both_ends_mirror_one(peer, local, own):
    assert is_own_socket(peer, local, OWN) is own




def test_a_codex_connection_that_shares_a_local_port_with_an_upstream_socket_is_served_not_killed():
    """Met in the namespace: three Codex agents and the proxy's own upstream connections on 127.0.0.1;
    Linux gave a Codex socket the local port of one of the proxy's sockets to the upstream, and its
    request was killed as "a loop" (and its connection taken for another user's)."""
    from types import SimpleNamespace

    from mitmproxy.test import tflow

    from codex_failover.mitm.self_guard import SelfGuard

    guard = SelfGuard(listeners=lambda: [("127.0.0.1", 8080)])
    upstream = SimpleNamespace(id="s1", sockname=("127.0.0.1", 40001), peername=("127.0.0.1", 443))
    guard.server_connected(SimpleNamespace(server=upstream))
    flow = tflow.tflow()
    flow.client_conn.peername, flow.client_conn.sockname = ("127.0.0.1", 40001), ("127.0.0.1", 8080)
    guard.requestheaders(flow)
    assert flow.error is None and not guard.is_own_socket(flow.client_conn.peername, flow.client_conn.sockname)
    looped = SimpleNamespace(id="s2", sockname=("127.0.0.1", 40002), peername=("127.0.0.1", 8080))
    guard.server_connected(SimpleNamespace(server=looped))  # the proxy's own connection to its listener
    flow.client_conn.peername = ("127.0.0.1", 40002)
    guard.requestheaders(flow)
    assert flow.error is not None  # killed: a loop
