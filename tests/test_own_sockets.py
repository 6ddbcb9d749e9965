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


def test_is_own_socket():
    ends = frozenset({("127.0.0.1", 40000)})
    assert is_own_socket(("::ffff:127.0.0.1", 40000, 0, 0), ends)
    assert not is_own_socket(("127.0.0.1", 40001), ends)
    assert not is_own_socket(None, ends)
