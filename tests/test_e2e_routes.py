"""End to end: credentials behind egress routes (HTTP CONNECT proxies, SOCKS5) that die."""

from __future__ import annotations

import base64
import time

import pytest
from harness import (
    Blackhole,
    FakeUpstreamProcess,
    LocalProxies,
    ProxyProcess,
    dead_port,
    pool_yaml,
    post_responses,
    served_by,
)

pytestmark = pytest.mark.e2e



@pytest.fixture
def proxies():
    local = LocalProxies()
    yield local
    local.close()


@pytest.fixture
def start_proxy(start_proxy):
    """Here the pool's own credentials serve (not the client's), through `routes`."""
    def start(fake, creds, routes, **policy):
        return start_proxy(fake, creds, routes, use_client_credential=False, **policy)
    return start


def dead():
    return f"http://127.0.0.1:{dead_port()}"


def call(proxy, fake):
    return post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good")


def test_first_endpoint_dead_second_endpoint_serves(fake, proxies, start_proxy):
    alive = proxies.http_proxy("alive")
    proxy = start_proxy(fake, [("work", "sk-test-work-good", "corp")], {"corp": [dead(), f"http://127.0.0.1:{alive}"]})
    reply = call(proxy, fake)
    assert reply.status == 200, reply.body[:300]
    assert served_by(reply) == "sk-test-work-good"
    assert proxies.connections["alive"] == 1
    assert "corp[0]" in proxy.log(), proxy.log()[-2000:]
    assert "failed before dispatch" in proxy.log(), proxy.log()[-2000:]


def test_whole_route_dead_next_credential_serves_and_backoff_then_probe(fake, proxies, start_proxy):
    refusing = proxies.http_proxy("refusing", mode="refuse")
    proxy = start_proxy(fake, [("work", "sk-test-work-good", "corp"), ("home", "sk-test-home-good")],
                        {"corp": [f"http://127.0.0.1:{refusing}"]}, route_backoff="1s")
    assert served_by(call(proxy, fake)) == "sk-test-home-good"
    assert proxies.connections["refusing"] == 1
    # In backoff: skipped without being dialled.
    assert served_by(call(proxy, fake)) == "sk-test-home-good"
    assert proxies.connections["refusing"] == 1
    time.sleep(1.2)  # backoff over: the next request probes it once
    assert served_by(call(proxy, fake)) == "sk-test-home-good"
    assert proxies.connections["refusing"] == 2
    # The probe shows the credential itself was never cooled for its route's fault.
    assert "credential work: route corp: no endpoint could be used" in proxy.log()


def test_reset_after_the_request_was_sent_is_not_replayed(fake, proxies, start_proxy):
    resetting = proxies.http_proxy("resetting", mode="reset")
    proxy = start_proxy(fake, [("work", "sk-test-work-good", "corp"), ("home", "sk-test-home-good")],
                        {"corp": [f"http://127.0.0.1:{resetting}"]})
    reply = call(proxy, fake)
    assert reply.status == 502, reply.body[:300]
    assert reply.json()["error"]["code"] == "upstream_connection_failed"
    assert [r["credential"] for r in fake.model_requests()] == ["sk-test-work-good"]  # never replayed


def test_tls_verification_failure_fails_closed(tmp_path, proxies, start_proxy):
    tls_fake = FakeUpstreamProcess(tmp_path, "--tls")
    try:
        text, env = pool_yaml(f"https://127.0.0.1:{tls_fake.port}", [("work", "sk-test-work-good"),
                                                                      ("home", "sk-test-home-good")],
                              use_client_credential=False)
        (tmp_path / "tls").mkdir()
        proxy = ProxyProcess(tmp_path / "tls", text, env)  # no ssl_insecure: the self-signed cert fails
        try:
            reply = post_responses(proxy.port, f"https://127.0.0.1:{tls_fake.port}/v1/responses", "sk-test-client-good",
                                   ca=proxy.confdir / "mitmproxy-ca-cert.pem")
            assert reply.status == 502
            assert "certificate" in reply.json()["error"]["message"].lower()
            assert "tls_failed" in proxy.log(), proxy.log()[-2000:]
            assert "not retried elsewhere" in proxy.log(), proxy.log()[-2000:]
            assert tls_fake.model_requests() == []
        finally:
            proxy.stop()
    finally:
        tls_fake.stop()


def test_socks5_route_serves(fake, proxies, start_proxy):
    socks = proxies.socks5("socks", users={"alice": "s3cret"})
    proxy = start_proxy(fake, [("work", "sk-test-work-good", "tunnel")], {"tunnel": [f"socks5://alice:s3cret@127.0.0.1:{socks}"]})
    reply = call(proxy, fake)
    assert reply.status == 200, reply.body[:300]
    assert served_by(reply) == "sk-test-work-good"
    assert proxies.connections["socks"] == 1
    assert "s3cret" not in proxy.log()


def test_proxy_credentials_reach_only_their_proxy(fake, proxies, start_proxy):
    a = proxies.http_proxy("a")
    b = proxies.http_proxy("b")
    proxy = start_proxy(fake, [("one", "sk-test-one-overload", "ra"), ("two", "sk-test-two-good", "rb")],
                        {"ra": [f"http://bob:pa%3Ass@127.0.0.1:{a}"], "rb": [f"http://127.0.0.1:{b}"]})
    assert served_by(call(proxy, fake)) == "sk-test-two-good"
    assert proxies.proxy_auth["a"] == ["Basic " + base64.b64encode(b"bob:pa:ss").decode()]
    assert proxies.proxy_auth["b"] == [None]
    assert not any(r["proxy_authorization"] for r in fake.model_requests())
    assert "pa:ss" not in proxy.log()
    assert "pa%3Ass" not in proxy.log()


def test_every_route_dead_gives_the_original_502_with_its_reason(fake, proxies, start_proxy):
    dead_url = dead()
    proxy = start_proxy(fake, [("work", "sk-test-work-good", "corp")], {"corp": [dead_url]})
    reply = call(proxy, fake)
    assert reply.status == 502
    message = reply.json()["error"]["message"]
    assert "route corp" in message
    assert f"corp[0] http://127.0.0.1:{dead_url.rsplit(':', 1)[1]}" in message
    assert "Connect call failed" in message or "refused" in message.lower()
    assert fake.model_requests() == []


def test_endpoint_timing_out_at_connect_is_skipped_for_the_next(fake, proxies, start_proxy):
    hole = Blackhole()
    try:
        alive = proxies.http_proxy("alive")
        proxy = start_proxy(fake, [("work", "sk-test-work-good", "corp")],
                            {"corp": [f"http://127.0.0.1:{hole.port}", f"http://127.0.0.1:{alive}"]}, connect_timeout="1s")
        started = time.monotonic()
        reply = call(proxy, fake)
        assert reply.status == 200, reply.body[:300]
        assert served_by(reply) == "sk-test-work-good"
        assert 1.0 <= time.monotonic() - started < 5.0
        assert "timed out connecting after 1s" in proxy.log(), proxy.log()[-2000:]
        assert "failed before dispatch" in proxy.log(), proxy.log()[-2000:]
        started = time.monotonic()
        assert served_by(call(proxy, fake)) == "sk-test-work-good"  # the dead one backs off: no wait now
        assert time.monotonic() - started < 1.0
    finally:
        hole.close()


def test_proxy_that_never_answers_connect_is_skipped_for_the_next(tmp_path, proxies):
    tls_fake = FakeUpstreamProcess(tmp_path, "--tls")
    try:
        silent = proxies.http_proxy("silent", mode="silent")
        alive = proxies.http_proxy("alive")
        base = f"https://127.0.0.1:{tls_fake.port}"
        text, env = pool_yaml(base, [("work", "sk-test-work-good", "corp")],
                              {"corp": [f"http://127.0.0.1:{silent}", f"http://127.0.0.1:{alive}"]},
                              use_client_credential=False, connect_timeout="1s")
        (tmp_path / "p").mkdir()
        proxy = ProxyProcess(tmp_path / "p", text, env, extra=["--set", "ssl_insecure=true"])
        try:
            reply = post_responses(proxy.port, f"{base}/v1/responses", "sk-test-client-good",
                                   ca=proxy.confdir / "mitmproxy-ca-cert.pem")
            assert reply.status == 200, reply.body[:300]
            assert served_by(reply) == "sk-test-work-good"
            assert proxies.connections["silent"] == 1
            assert proxies.connections["alive"] == 1
            assert "corp[0]" in proxy.log(), proxy.log()[-2000:]
            assert "timed out connecting after 1s" in proxy.log(), proxy.log()[-2000:]
        finally:
            proxy.stop()
    finally:
        tls_fake.stop()
