"""Route parsing, endpoint backoff and probing, connection failure classes. Pure."""

import pytest
from conftest import Clock

from codex_failover.config import ConfigError, parse_pool
from codex_failover.core.routes import RouteError, RouteHealth, parse_endpoint, parse_routes
from codex_failover.core.transport import classify_connection_error
from codex_failover.core.vocabulary import AMBIGUOUS, HOST_NETWORK, PRE_DISPATCH, TLS_FAILED


def test_parse_routes():
    routes = parse_routes({"corp": ["http://a:3128", "http://u:p%40ss@b:3128"], "tunnel": ["socks5h://127.0.0.1:1080"],
                           "home": "direct"})
    a, b = routes["corp"]
    assert (a.scheme, a.host, a.port, a.username) == ("http", "a", 3128, None)
    assert (b.username, b.password) == ("u", "p@ss")
    assert "p@ss" not in repr(b)
    assert "p@ss" not in b.label
    assert routes["tunnel"][0].scheme == "socks5"
    assert routes["tunnel"][0].is_socks
    assert routes["home"] is None
    assert parse_endpoint("r", 0, "https://proxy").port == 443


@pytest.mark.parametrize(
    "doc,needle",
    [
        ({"r": ["ftp://x:21"]}, "unsupported scheme 'ftp'"),
        ({"r": ["http://x:notaport"]}, "cannot parse"),
        ({"r": ["http:///nohost"]}, "expected scheme://"),
        ({"r": []}, "non-empty list"),
        ({"r": "elsewhere"}, "non-empty list of proxy URLs, or direct"),
        (["x"], "expected a mapping"),
    ],
)
def test_bad_routes(doc, needle):
    with pytest.raises(RouteError, match=needle):
        parse_routes(doc)


def test_unknown_route_name_in_pool():
    doc = {"routes": {"corp": ["http://a:1"]}, "credentials": [{"name": "w", "api_key_env": "K", "route": "nope"}]}
    with pytest.raises(ConfigError, match=r"credentials\[0\].route: unknown route 'nope' \(routes: corp\)"):
        parse_pool(doc, "p.yaml", {"K": "sk-x"}, None)


def test_backoff_doubles_to_the_cap_and_one_probe_at_a_time():
    clock = Clock(100.0)
    health = RouteHealth(floor=30, cap=300, clock=clock)
    ep = parse_routes({"r": ["http://a:1"]})["r"][0]
    assert health.claim(ep)
    assert [health.failed(ep, "refused") for _ in range(6)] == [30, 60, 120, 240, 300, 300]
    assert not health.claim(ep)
    assert "backing off 300s" in health.describe(ep)
    clock.now += 300
    assert health.claim(ep)
    assert not health.claim(ep)  # the first caller probes, others skip
    health.succeeded(ep)
    assert health.claim(ep)
    assert health.describe(ep) == "up"


@pytest.mark.parametrize(
    "message,expected",
    [
        # what mitmproxy 12.3.1 reports on the attempt flow, from real runs
        ("[Errno 111] Connect call failed ('127.0.0.1', 40401)", PRE_DISPATCH),
        ("Upstream proxy 127.0.0.1:3128 refused HTTP CONNECT request: 403 Forbidden", PRE_DISPATCH),
        ("Upstream proxy 127.0.0.1:3128 refused HTTP CONNECT request: 502 Bad Gateway", PRE_DISPATCH),
        ("Error connecting to 127.0.0.1:3128: Invalid HTTP response", PRE_DISPATCH),
        ("[Errno -2] Name or service not known", HOST_NETWORK),
        ("[Errno -3] Temporary failure in name resolution", HOST_NETWORK),
        ("[Errno 101] Network is unreachable", HOST_NETWORK),
        ("Certificate verify failed: self-signed certificate", TLS_FAILED),
        ("HTTP/1 protocol error: peer closed connection without sending complete message body", AMBIGUOUS),
        ("Connection reset by peer", AMBIGUOUS),
    ],
)
def test_connection_failure_classes(message, expected):
    assert classify_connection_error(message, response_started=False) == expected


def test_a_socks_endpoint_at_an_ipv6_literal_is_dialled_in_brackets():
    from codex_failover.core.routes import parse_endpoint
    from codex_failover.net.socks_bridge import _proxy_url

    ep = parse_endpoint("tunnel", 0, "socks5://u:p@[::1]:1080")
    assert _proxy_url(ep) == "socks5://u:p@[::1]:1080"
