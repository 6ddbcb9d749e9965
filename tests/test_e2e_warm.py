"""End to end: attempts reuse warm upstream connections (issue 16). Connections are counted where
they arrive: the fake upstream numbers each TCP connection it accepts and logs it with every request."""

from __future__ import annotations

import json
import socket
import time

import pytest
from h2_client import H2Client
from harness import (
    FakeUpstreamProcess,
    MitmwebProcess,
    ProxyProcess,
    pool_yaml,
    post_responses,
    proxy_status,
    served_by,
    start_raw_post,
    wait_until,
)

pytestmark = pytest.mark.e2e


def upstream_conns(fake) -> list[int]:
    return [r["conn"] for r in fake.model_requests()]


def close_idle(fake) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=5)
    conn.request("POST", "/_fake/close-idle", body=b"{}")
    closed = json.loads(conn.getresponse().read())["closed"]
    conn.close()
    return closed


def open_upstream(proxy) -> int:
    return sum(entry["open"] for entry in proxy_status(proxy.port)["upstream_connections"].values())


# The kept connections carry every attempt here (failover_direct=false): the first attempt otherwise
# rides the client's own connection (tests/test_e2e_direct.py).
KEPT = ("--set", "failover_direct=false")


def test_sequential_requests_share_one_upstream_connection(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], extra=KEPT)
    for _ in range(5):
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good")
        assert reply.status == 200, reply.body[:300]
    conns = upstream_conns(fake)
    assert len(conns) == 5, f"the fake saw {len(conns)} model requests"
    assert len(set(conns)) == 1, f"5 sequential requests used upstream connections {conns}"


def test_a_warm_connection_the_upstream_closed_is_replaced_without_error_or_penalty(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    url = f"{fake.base}/v1/responses"
    assert post_responses(proxy.port, url, "sk-test-client-good").status == 200
    assert close_idle(fake) >= 1, "the fake had no idle connection to close"
    wait_until(lambda: open_upstream(proxy) == 0, timeout=5, what="the proxy to notice the closed connection")
    reply = post_responses(proxy.port, url, "sk-test-client-good")
    assert reply.status == 200, reply.body[:300]
    assert served_by(reply) == "sk-test-client-good", "the client's own credential must serve (no failover)"
    first, second = upstream_conns(fake)
    assert first != second, "the second request must come on a new connection"
    report = proxy_status(proxy.port)
    assert all(c["state"] == "ready" for c in report["clients"]), report["clients"]
    assert "verdict=failed" not in proxy.log()


def test_the_spares_connection_is_dialled_while_the_first_attempt_is_held(fake, start_proxy):
    """The fake speaks HTTP/1.1: the client's attempt holds the warm connection, so the spare's
    connection is dialled when the request starts (pre-warm), before any rejection; a failover
    then dials nothing."""
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], extra=KEPT, bootstrap_timeout="30s")
    url = f"{fake.base}/v1/responses"
    assert post_responses(proxy.port, url, "sk-test-client-good").status == 200
    dials_before = proxy_status(proxy.port)["upstream_dials"]
    sock = start_raw_post(proxy.port, url, "sk-test-client-stall-first")  # held: no rejection, no output
    try:
        wait_until(lambda: open_upstream(proxy) == 2, timeout=5, what="the spare's connection to be pre-warmed")
        assert proxy_status(proxy.port)["upstream_dials"] == dials_before + 1
    finally:
        sock.close()
    wait_until(lambda: proxy_status(proxy.port)["held_requests"] == 0, timeout=5, what="the held request to end")
    dials_before = proxy_status(proxy.port)["upstream_dials"]
    reply = post_responses(proxy.port, url, "sk-test-client-overload")
    assert served_by(reply) == "sk-test-spare-good"
    rejected, spare = upstream_conns(fake)[-2:]
    assert spare != rejected, "the spare must not wait for the rejected attempt's connection"
    assert proxy_status(proxy.port)["upstream_dials"] - dials_before <= 1, "one pre-warm dial at most, none after"


def test_a_client_leaving_during_the_hold_cancels_at_once(fake, start_proxy):
    """The client flow points at the relay from the start of the hold: a client that leaves while
    the attempt is still in its bootstrap window is noticed by the relay's hop, at once."""
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], bootstrap_timeout="30s")
    sock: socket.socket = start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-stall-first")
    wait_until(lambda: fake.model_requests(), timeout=5, what="the attempt to reach the fake")
    time.sleep(0.3)
    sock.close()
    wait_until(lambda: "client went away" in proxy.log(), timeout=3, what="the run to notice the client left")
    wait_until(lambda: any(r.get("event") == "peer_closed" for r in fake.requests()), timeout=3,
               what="the upstream attempt to be cancelled")


def test_a_pool_change_closes_the_kept_connections(tmp_path):
    fake = FakeUpstreamProcess(tmp_path)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    web = MitmwebProcess(tmp_path / "web", text, env, extra=list(KEPT))
    try:
        url = f"{fake.base}/v1/responses"
        assert post_responses(web.port, url, "sk-test-client-good").status == 200
        assert open_upstream(web) == 2  # the client's and the spare's (pre-warmed): one per credential
        changed = tmp_path / "changed.yaml"
        changed.write_text(text)
        web.put("/options", {"failover_config": str(changed)})
        wait_until(lambda: open_upstream(web) == 0, timeout=5, what="the kept connection to close")
        assert post_responses(web.port, url, "sk-test-client-good").status == 200
        first, second = upstream_conns(fake)
        assert first != second, "after a pool change the next request must use a new connection"
    finally:
        web.stop()
        fake.stop()


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_an_http2_client_resetting_its_held_stream_cancels_the_attempt(tmp_path, delay):
    """Codex over HTTP/2 resets a stream it gives up on. At 0.05 s the reset arrives while the
    addon's request hook still runs or while attempt 1's connection (the stream's own) is dialled: the
    request never leaves, or is stopped once it has; at 0.3 s the upstream has it and it is reset. Either
    way the attempt is cancelled at once, and the connection's next request is served."""
    fake = FakeUpstreamProcess(tmp_path / "fake", "--tls", "--stall", "30")
    text, env = pool_yaml(f"https://127.0.0.1:{fake.port}", [("spare", "sk-test-spare-good")], bootstrap_timeout="20s")
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", "ssl_insecure=true"])
    client = H2Client(proxy.port, f"127.0.0.1:{fake.port}", proxy.confdir / "mitmproxy-ca-cert.pem")
    try:
        held = client.post_model("sk-test-client-stall")
        time.sleep(delay)
        client.reset(held)

        def cancelled() -> bool:  # the request reached the upstream and was stopped there, or never left
            # (attempt 1 rides the stream: a reset while its connection is dialled stops it before it is sent)
            if any(r.get("event") == "peer_closed" for r in fake.requests()):
                return True
            return not fake.model_requests() and proxy_status(proxy.port)["held_requests"] == 0
        wait_until(cancelled, timeout=5, what="the attempt to be cancelled")
        following = client.wait(client.post_model("sk-test-client-good"))
        assert following.status == 200
        assert following.ended
        assert b"response.completed" in following.data
        status = wait_until(lambda: (s := proxy_status(proxy.port))["held_requests"] == 0 and s, timeout=3,
                            what="no request held any more")
        assert status["attempts_in_flight"] == 0, status
        assert "Traceback" not in proxy.log()
    finally:
        client.close()
        proxy.stop()
        fake.stop()


def test_each_credential_has_connections_of_its_own(fake, tmp_path):
    """The upstream never sees two accounts on one connection: the client's overloaded attempts and
    the spare's answers, on one upstream host, never share a connection (they did when kept
    connections were keyed by host alone)."""
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good"), ("third", "sk-test-third-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        url = f"{fake.base}/v1/responses"
        for _ in range(3):
            assert post_responses(proxy.port, url, "sk-test-client-overload").status == 200
        fake.overload_next("sk-test-spare-good", count=1)
        assert post_responses(proxy.port, url, "sk-test-client-overload").status == 200  # client, spare, third
    finally:
        proxy.stop()
    conns: dict[str, set[int]] = {}
    for r in fake.model_requests():
        conns.setdefault(r["credential"], set()).add(r["conn"])
    assert set(conns) == {"sk-test-client-overload", "sk-test-spare-good", "sk-test-third-good"}, conns
    seen = [c for ids in conns.values() for c in ids]
    assert len(seen) == len(set(seen)), f"two credentials shared a connection: {conns}"
    assert len(conns["sk-test-spare-good"]) == 1, conns  # kept: the spare's requests reuse its connection
