"""The direct attempt (mitm/direct.py) where it waits and where mitmproxy writes for it later: a client
that leaves or resets while its stream's connection request waits for the run, a dial that hangs, and
an HTTP/2 upstream that queues the head. Each as with failover_direct=false (the stand-in at once)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from harness import ProxyProcess, post_responses, start_raw_post

pytestmark = pytest.mark.e2e
CLIENT = "sk-test-client-good"


def _cooling_proxy(tmp_path, fake, extra=None):
    text = (f"base_urls: [{fake.base}/v1]\n"
            "policy: {cooldown_wait: 5s, bootstrap_timeout: 5s}\n")
    return ProxyProcess(tmp_path / "proxy", text, extra=extra)


def _cool_the_client(proxy, fake):
    """The client's own credential cools ~1 s (a 429 with Retry-After: 1, answered to the client)."""
    fake.overload_next(CLIENT, 1, "rate-429")
    reply = post_responses(proxy.port, f"{fake.base}/v1/responses", CLIENT, timeout=10)
    assert reply.status == 429


def test_client_that_closes_while_its_stream_is_parked_is_not_sent_upstream(tmp_path, fake):
    """The request hook returns after DISPATCH_FIRST (0.5 s) while the run waits for the cooling
    credential (cooldown_wait): the stream parks its GetHttpConnection. The client closes at 0.8 s.
    Expected: the run stops (the client is gone) and no model request goes upstream for it."""
    proxy = _cooling_proxy(tmp_path, fake)
    try:
        _cool_the_client(proxy, fake)
        before = len(fake.model_requests())
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", CLIENT)
        time.sleep(0.8)
        sock.close()
        time.sleep(3.0)  # past the cooldown: the run's Try would have happened
        after = fake.model_requests()[before:]
        log = proxy.log()
    finally:
        proxy.stop()
    assert after == [], f"sent upstream after the client left: {after}"
    assert "client went away" in log


@pytest.mark.parametrize("direct", ["true", "false"])
def test_http2_reset_while_the_stream_is_parked_stops_the_run_before_anything_is_sent(tmp_path, tls_fake, direct):
    """As above over HTTP/2: the client resets its stream at 0.8 s while the run waits for the cooling
    credential. The stream's GetHttpConnection is parked, so the reset is queued in the paused
    stream: nobody sees it until the run's Try. Expected (as with failover_direct=false, where the
    stand-in gets the reset at once): nothing more goes upstream."""
    from h2_client import H2Client
    key = "sk-test-client-rate-429"  # 429 with Retry-After: 1 each time: the client's credential cools 1 s
    text = (f"base_urls: [{tls_fake.base}/v1]\n"
            "policy: {cooldown_wait: 5s, bootstrap_timeout: 5s}\n")
    proxy = ProxyProcess(tmp_path / "proxy", text, extra=["--set", "ssl_insecure=true", "--set", f"failover_direct={direct}"])
    client = None
    try:
        client = H2Client(proxy.port, f"127.0.0.1:{tls_fake.port}", proxy.confdir / "mitmproxy-ca-cert.pem")
        first = client.wait(client.post_model(key), timeout=10)
        assert first.status == 429
        second = client.post_model(key)
        time.sleep(0.8)
        client.reset(second)
        time.sleep(3.0)
        models = tls_fake.model_requests()
        log = proxy.log()
    finally:
        if client is not None:
            client.close()
        proxy.stop()
    assert len(models) == 1, f"{len(models) - 1} model request(s) sent after the client reset its stream\n{log[-3000:]}"


@pytest.mark.parametrize("direct", ["true", "false"])
def test_a_direct_attempt_whose_dial_hangs_still_lets_the_client_get_the_spares_answer(tmp_path, fake, direct):
    """The client's own URL does not answer its SYNs (a listening socket whose accept queue is full):
    attempt 1 (direct, on the client's credential) never connects, connect_timeout (1 s) fails it
    over to the spare, whose answer must reach the client: the stream, waiting on mitmproxy's own dial
    (no timeout of its own), is given its stand-in by the cancel."""
    from harness import pool_yaml
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    port = hole.getsockname()[1]
    fillers = []
    for _ in range(2):  # fill the accept queue: further SYNs are dropped
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    time.sleep(0.2)
    probe = socket.socket()
    probe.settimeout(1.0)
    with pytest.raises((TimeoutError, socket.timeout)):
        probe.connect(("127.0.0.1", port))
    probe.close()
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")], connect_timeout="1s")
    text = f"base_urls: [http://127.0.0.1:{port}/v1]\n" + text
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", f"failover_direct={direct}"])
    try:
        started = time.monotonic()
        try:
            reply = post_responses(proxy.port, f"http://127.0.0.1:{port}/v1/responses", CLIENT, timeout=12)
            status, body = reply.status, reply.body
        except (TimeoutError, socket.timeout) as exc:
            status, body = None, repr(exc).encode()
        took = time.monotonic() - started
        log = proxy.log()
    finally:
        proxy.stop()
        for s in fillers:
            s.close()
        hole.close()
    assert status == 200 and b"response.completed" in body, (status, took, body[:300], log[-2500:])



@pytest.mark.parametrize("direct", ["true", "false"])
def test_a_direct_head_queued_by_http2_stream_concurrency_leaves_with_the_real_credential(tmp_path, direct):
    """Two held requests on one HTTP/2 client connection, an h2 upstream allowing one stream at a time:
    mitmproxy's Http2Client queues the second RequestHeaders event (stream_queue) and sends it later,
    reading `event.request.headers` then: the wire's head has a request object of its own."""
    import subprocess
    from pathlib import Path

    from h2_client import H2Client
    from harness import PYTHON, STARTED, stop
    server = subprocess.Popen([PYTHON, str(Path(__file__).parent / "support" / "h2_one_stream.py")],
                              stdout=subprocess.PIPE, text=True)
    STARTED.append(server)
    port = json.loads(server.stdout.readline())["listening"]
    text = f"base_urls: [https://127.0.0.1:{port}/v1]\npolicy: {{bootstrap_timeout: 5s}}\n"
    proxy = ProxyProcess(tmp_path / "proxy", text, extra=["--set", "ssl_insecure=true", "--set", f"failover_direct={direct}"])
    client = None
    try:
        client = H2Client(proxy.port, f"127.0.0.1:{port}", proxy.confdir / "mitmproxy-ca-cert.pem")
        a = client.post_model("sk-test-client-A")
        time.sleep(0.3)
        b = client.post_model("sk-test-client-B")
        client.wait(a, timeout=15)
        client.wait(b, timeout=15)
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        stop(server)
    got = [json.loads(line)["authorization"] for line in server.stdout.read().splitlines() if "authorization" in line]
    assert "Bearer sk-test-client-B" in got, f"the upstream got {got}"
    assert b.status == 200 and b"response.completed" in b.data
