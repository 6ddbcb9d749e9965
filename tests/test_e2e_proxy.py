"""End to end: a real `mitmdump -s addon/failover.py`, the fake upstream, a client through the proxy."""

from __future__ import annotations

import json
import threading
import time

import pytest
from harness import (
    FakeUpstreamProcess,
    ProxyProcess,
    dead_port,
    free_port,
    pool_yaml,
    post_responses,
    proxy_status,
    request,
    start_raw_post,
    wait_until,
)

pytestmark = pytest.mark.e2e



def url(fake):
    return f"{fake.base}/v1/responses"


def types(reply):
    return [e["type"] for e in reply.events()]


def test_own_credential_overloaded_spare_serves(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert reply.status == 200
    kinds = types(reply)
    assert kinds.count("response.created") == 1
    assert "error" not in kinds
    assert "response.failed" not in kinds
    assert kinds[-1] == "response.completed"
    assert "Hello from sk-test-spare-good" in reply.body.decode()
    served = [r["credential"] for r in fake.model_requests()]
    assert served == ["sk-test-client-overload", "sk-test-spare-good"]
    log = proxy.log()
    assert "attempt 1/" in log, log[-2000:]
    assert "verdict=failover reason=overloaded" in log, log[-2000:]
    assert "verdict=commit" in log, log[-2000:]
    assert "sk-test-" not in log  # never a secret in the log


def test_three_overloaded_then_one_good(fake, start_proxy):
    proxy = start_proxy(fake, [("a", "sk-test-a-overload"), ("b", "sk-test-b-overload-eof"), ("c", "sk-test-c-good")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-slow-down")
    assert reply.status == 200, reply.body[:300]
    assert types(reply)[-1] == "response.completed"
    assert "Hello from sk-test-c-good" in reply.body.decode()
    assert len(fake.model_requests()) == 4


def test_all_overloaded_gives_503_with_attempts_and_the_time(fake, start_proxy):
    # The whole pool may rest (max_held_out: 100%), so every credential cools.
    proxy = start_proxy(fake, [("a", "sk-test-a-overload"), ("b", "sk-test-b-overload-503")], max_retry_after="3s",
                        overload={"max_held_out": "100%"})
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert reply.status == 503
    # Nothing is back within max_retry_after: no Retry-After (Codex gives up after its quick tries
    # instead of waiting it out), but the body says when the first credential is back.
    assert "retry-after" not in reply.headers
    error = reply.json()["error"]
    assert 10 <= error["retry_after_seconds"] <= 15  # the first rest of an overload streak
    assert error["code"] == "server_is_overloaded"
    assert error["type"] == "service_unavailable_error"
    assert [a["credential"] for a in error["attempts"]] == ["client", "a", "b"]
    assert all(a["verdict"] == "failover" for a in error["attempts"])
    assert "sk-test" not in reply.body.decode()
    # Every credential is cooling now: the next request is answered at once, nothing dialled.
    before = len(fake.model_requests())
    started = time.monotonic()
    again = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert again.status == 503, again.body[:300]
    assert time.monotonic() - started < 1.0
    assert len(fake.model_requests()) == before
    assert {c["state"] for c in again.json()["error"]["credentials"]} == {"cooling"}


def test_the_own_key_and_one_spare_both_resting_the_next_request_probes_one_and_is_served(fake, start_proxy):
    """The client's own key plus one spare, on the defaults (a share of the pool rests for overload: the
    pooled credentials only, so the own key rests by its streak alone), both overloaded in a burst:
    the next request probes the least recently failed (the own) once after 0.5 s and is served, instead
    of `503 (not dialled)` for both rests (docs/pool-file.md#overload-cooldowns)."""
    proxy = start_proxy(fake, [("a", "sk-test-a-good")])
    fake.overload_next("sk-test-client-good", 1)
    fake.overload_next("sk-test-a-good", 1)
    first = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert first.status == 503, first.body[:300]
    assert [a["credential"] for a in first.json()["error"]["attempts"]] == ["client", "a"]
    started = time.monotonic()
    again = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert again.status == 200, again.body[:300]
    assert "Hello from sk-test-client-good" in again.body.decode()
    assert time.monotonic() - started >= 0.5, "probed after its 0.5 s"
    assert len(fake.model_requests()) == 3, "one probe, nothing else dialled"
    assert "no credential ready; probing client in 0.5s (resting for an overload, the least recently failed)" in proxy.log()
    assert "not dialled" not in proxy.log()


def test_at_most_a_share_of_the_pool_rests_for_overload_and_the_least_recently_failed_is_tried(fake, start_proxy):
    proxy = start_proxy(fake, [("a", "sk-test-a-overload"), ("b", "sk-test-b-overload"), ("c", "sk-test-c-overload")],
                        use_client_credential=False)
    first = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert first.status == 503
    # A quarter of three is less than one: one rests (c, the last to fail); a and b are back.
    assert "credential a is back in rotation early" in proxy.log()
    states = {c["name"]: c["state"] for c in proxy_status(proxy.port)["credentials"]}
    assert states == {"a": "ready", "b": "ready", "c": "cooling"}
    before = len(fake.model_requests())
    again = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert again.status == 503 and "every credential is cooling" not in again.body.decode()
    assert [r["credential"] for r in fake.model_requests()[before:]][0] == "sk-test-a-overload"
    assert "retry-after" not in again.headers  # nothing tried is a promise


def test_usage_limit_cools_the_credential_and_the_next_request_skips_it(fake, start_proxy):
    proxy = start_proxy(fake, [("limited", "sk-test-limited-usage-limit"), ("good", "sk-test-good-good")],
                        use_client_credential=False)
    first = post_responses(proxy.port, url(fake), "sk-test-client-good")
    second = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert first.status == second.status == 200
    served = [r["credential"] for r in fake.model_requests()]
    assert served == ["sk-test-limited-usage-limit", "sk-test-good-good", "sk-test-good-good"]


@pytest.mark.parametrize("scenario,first_type", [("delta-overload", "response.output_text.delta"),
                                                  ("websearch-overload", "response.output_item.added")])
@pytest.mark.parametrize("own", [True, False], ids=["direct", "pool-only"])
def test_an_overload_after_output_ends_the_stream_for_a_resend_that_moves(fake, start_proxy, scenario, first_type, own):
    """An overload after the output began, while no whole item but reasoning is out: the client gets the
    output's events and a stream that ends there, without the rejection and without response.completed
    (Codex re-sends such a request); the credential cools, so the re-send is served by the spare.
    Before: the overload was delivered in-stream and Codex ended the turn. Both ways a stream reaches
    the client: on its own stream (direct) and through the stand-in (a pool credential's attempt)."""
    client = f"sk-test-client-{scenario}"
    pool = [("spare", "sk-test-spare-good")] if own else [("first", f"sk-test-first-{scenario}"), ("spare", "sk-test-spare-good")]
    proxy = start_proxy(fake, pool, use_client_credential=own)
    first = client if own else f"sk-test-first-{scenario}"
    reply = post_responses(proxy.port, url(fake), client)
    assert reply.status == 200
    kinds = types(reply)
    assert not {"error", "response.failed"} & set(kinds), kinds  # never the rejection
    if "response.completed" in kinds:
        # The overload came in the same read as the first output: seen before anything went out, an
        # ordinary failover (core/attempt_machine.py `_after_output`); which read it comes in is timing.
        assert "Hello from sk-test-spare-good" in reply.body.decode()
        assert [r["credential"] for r in fake.model_requests()] == [first, "sk-test-spare-good"]
        return
    assert first_type in kinds, kinds
    assert reply.body.endswith(b"\n\n")  # whole events only
    again = post_responses(proxy.port, url(fake), client)
    assert again.status == 200 and "response.completed" in types(again)
    assert [r["credential"] for r in fake.model_requests()] == [first, "sk-test-spare-good"]
    assert "rejected after its output began" in proxy.log()


def test_invalid_request_passes_through(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-invalid")
    assert reply.status == 400, reply.body[:300]
    assert reply.json()["error"]["code"] == "invalid_value"
    assert len(fake.model_requests()) == 1


def test_pooled_credentials_401_never_reaches_the_client(fake, start_proxy):
    proxy = start_proxy(fake, [("broken", "sk-test-broken-unauthorized"), ("good", "sk-test-good-good")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert reply.status == 200, reply.body[:300]
    assert "Hello from sk-test-good-good" in reply.body.decode()
    assert "taken out of rotation" in proxy.log()
    # Out of rotation: never dialled again.
    post_responses(proxy.port, url(fake), "sk-test-client2-overload")
    assert [r["credential"] for r in fake.model_requests()].count("sk-test-broken-unauthorized") == 1


def test_pooled_401_alone_becomes_503_not_401(fake, start_proxy):
    proxy = start_proxy(fake, [("broken", "sk-test-broken-unauthorized")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert reply.status == 503


def test_clients_own_401_is_returned_as_is(fake, start_proxy):
    proxy = start_proxy(fake, [("good", "sk-test-good-good")])
    reply = post_responses(proxy.port, url(fake), "sk-test-client-unauthorized")
    assert reply.status == 401, reply.body[:300]
    assert len(fake.model_requests()) == 1


def test_client_disconnect_cancels_the_upstream(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], bootstrap_timeout="60s")
    sock = start_raw_post(proxy.port, url(fake), "sk-test-client-stall")
    deadline = time.monotonic() + 5
    while not fake.model_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    sock.close()
    closed_at = time.monotonic()
    while time.monotonic() - closed_at < 3:
        if any(r.get("event") == "peer_closed" for r in fake.requests()):
            break
        time.sleep(0.02)
    else:
        pytest.fail("upstream attempt was not cancelled within 3 s of the client leaving")
    assert time.monotonic() - closed_at < 1.0
    # Logged once the attempt's cancel returned, just after the upstream saw the close.
    wait_until(lambda: "client went away" in proxy.log(), timeout=5, what="the log line")


def test_two_clients_concurrently(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], bootstrap_timeout="60s")
    slow = {}

    def held():
        try:
            slow["reply"] = post_responses(proxy.port, url(fake), "sk-test-client-stall", timeout=3)
        except OSError as exc:
            slow["error"] = exc

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    fast = post_responses(proxy.port, url(fake), "sk-test-other-good")
    assert fast.status == 200, fast.body[:300]
    assert time.monotonic() - started < 2.0
    thread.join(timeout=10)


def test_client_sees_the_first_event_before_upstream_finishes(tmp_path, start_proxy):
    slow = FakeUpstreamProcess(tmp_path, "--pace", "0.05", "--deltas", "20")
    try:
        proxy = start_proxy(slow, [("spare", "sk-test-spare-good")])
        reply = post_responses(proxy.port, url(slow), "sk-test-client-overload")
        assert reply.status == 200, reply.body[:300]
        assert len(reply.chunks) > 5
        total = reply.chunks[-1][0]
        assert reply.first_byte_s < total - 0.5  # streamed live, not buffered
    finally:
        slow.stop()


def test_non_codex_traffic_untouched(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    models = request(proxy.port, "GET", f"{fake.base}/v1/models", headers={"authorization": "Bearer sk-test-client-overload"})
    assert models.status == 200, models.body[:300]
    assert json.loads(models.body)["path"] == "/v1/models"
    # A non-streaming call to /responses is not held either: it goes straight through.
    plain = request(proxy.port, "POST", url(fake), headers={"authorization": "Bearer sk-test-client-invalid",
                                                            "content-type": "application/json"},
                    body=json.dumps({"stream": False, "input": []}).encode())
    assert plain.status == 400
    assert [r["credential"] for r in fake.requests()] == ["sk-test-client-overload", "sk-test-client-invalid"]
    assert "attempt 1/" not in proxy.log()


@pytest.mark.parametrize("mode", ["downgrade", None])
def test_websocket_upgrade_gets_426_with_downgrade_and_101_on_the_defaults(fake, start_proxy, mode):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")],
                        extra=["--set", f"failover_websocket={mode}"] if mode else ())
    if mode == "downgrade":
        reply = request(proxy.port, "GET", url(fake), headers={
            "upgrade": "websocket", "connection": "Upgrade", "sec-websocket-version": "13",
            "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==", "authorization": "Bearer sk-test-client-good"})
        assert reply.status == 426
        assert fake.requests() == []
        return
    from harness import WsClient, WsRejected  # the gate: the client's own credential's socket accepted
    client = WsClient.connect(proxy.port, url(fake), {"authorization": "Bearer sk-test-client-good"})
    assert not isinstance(client, WsRejected), client
    client.close()
    assert [r["credential"] for r in fake.requests() if r.get("websocket")] == ["sk-test-client-good"]


def test_https_through_connect_with_the_proxy_ca(tmp_path):
    tls_fake = FakeUpstreamProcess(tmp_path, "--tls", "--pace", "0.002", "--deltas", "5")
    base = f"https://127.0.0.1:{tls_fake.port}"
    text, env = pool_yaml(base, [("spare", "sk-test-spare-good")])
    # The fake's certificate is self-signed: only this test tells mitmproxy not to verify it.
    proxy = ProxyProcess(tmp_path, text, env, extra=["--set", "ssl_insecure=true"])
    try:
        ca = proxy.confdir / "mitmproxy-ca-cert.pem"
        reply = post_responses(proxy.port, f"{base}/v1/responses", "sk-test-client-overload", ca=ca)
        assert reply.status == 200
        kinds = types(reply)
        assert kinds.count("response.created") == 1
        assert "error" not in kinds
        assert kinds[-1] == "response.completed"
        assert "Hello from sk-test-spare-good" in reply.body.decode()
    finally:
        proxy.stop()
        tls_fake.stop()


def test_saved_flows_hold_no_pooled_secret(fake, tmp_path):
    dead = f"http://127.0.0.1:{dead_port()}"
    text = (f"credentials:\n  - {{name: dead, api_key_env: KEY_DEAD, base_url: {dead}/v1}}\n"
            f"  - {{name: good, api_key_env: KEY_GOOD, base_url: {fake.base}/v1}}\n")
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path, text, {"KEY_DEAD": "sk-test-secret-dead", "KEY_GOOD": "sk-test-secret-good"},
                         extra=["-w", str(saved)])
    try:
        reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
        assert reply.status == 200, reply.body[:300]
        assert "Hello from sk-test-secret-good" in reply.body.decode()
        assert "credential=dead route=direct verdict=failed reason=pre_dispatch" in proxy.log()
        assert "Addon error" not in proxy.log()
    finally:
        proxy.stop()
    data = saved.read_bytes()
    assert b"<redacted by codex-failover>" in data  # the client's flow and every attempt: placeholders
    # (The fake upstream echoes a test key in its answer text, so look for it as a credential.)
    for key in (b"sk-test-client-overload", b"sk-test-secret-dead", b"sk-test-secret-good"):
        assert b"Bearer " + key not in data


def test_max_retry_after_zero_sends_no_retry_after(fake, start_proxy):
    proxy = start_proxy(fake, [("a", "sk-test-a-overload")], max_retry_after="0")
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert reply.status == 503, reply.body[:300]
    assert "retry-after" not in reply.headers


def test_without_a_pool_the_own_credential_is_retried_with_backoff(fake, tmp_path):
    # No credentials: only tell the addon that the fake is a model endpoint.
    proxy = ProxyProcess(tmp_path, f"base_urls: [{fake.base}/v1]\n")
    try:
        started = time.monotonic()
        reply = post_responses(proxy.port, url(fake), "sk-test-client-overload-once")
        elapsed = time.monotonic() - started
    finally:
        proxy.stop()
    assert reply.status == 200, reply.body[:300]
    assert types(reply)[-1] == "response.completed"
    assert "error" not in types(reply)
    assert [r["credential"] for r in fake.model_requests()] == ["sk-test-client-overload-once"] * 2
    assert elapsed >= 0.5  # the first backoff step


def test_holds_for_a_credential_recovering_within_cooldown_wait(fake, start_proxy):
    # The whole pool may rest (else the least recently failed is tried at once, without a hold).
    proxy = start_proxy(fake, [("spare", "sk-test-spare-overload-once")], overload_cooldown="1s", cooldown_wait="3s",
                        overload={"max_held_out": "100%"})
    first = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert first.status == 503
    started = time.monotonic()
    second = post_responses(proxy.port, url(fake), "sk-test-client-overload")
    assert second.status == 200, second.body[:300]
    assert "Hello from sk-test-spare-overload-once" in second.body.decode()
    assert 0.5 <= time.monotonic() - started < 3.5


def test_zstd_request_body_is_recognised_and_moved(fake, start_proxy):
    from conftest import LIVE

    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    body = (LIVE / "chatgpt_http_post_responses.body.zst").read_bytes()
    conn_reply = _raw_post(proxy.port, url(fake), "sk-test-client-overload", body,
                           {"content-encoding": "zstd", "x-codex-turn-state": "turn-of-client"})
    assert b"Hello from sk-test-spare-good" in conn_reply
    client, spare = fake.model_requests()
    assert client["turn_state"] == "turn-of-client"
    assert spare["turn_state"] is None  # dropped when moved
    assert client["body_bytes"] == spare["body_bytes"] == len(body)  # the same zstd bytes, untouched


def _raw_post(port, target, token, body, headers):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", target, body=body, headers={"authorization": f"Bearer {token}",
                                                      "content-type": "application/json", **headers})
    data = conn.getresponse().read()
    conn.close()
    return data


def test_client_disconnect_after_commit_cancels_the_upstream(tmp_path, start_proxy):
    slow = FakeUpstreamProcess(tmp_path, "--pace", "0.2", "--deltas", "40")
    try:
        proxy = start_proxy(slow, [("spare", "sk-test-spare-good")])
        sock = start_raw_post(proxy.port, url(slow), "sk-test-client-good", timeout=10)
        received = b""
        while b"response.output_text.delta" not in received and b"summary_text.delta" not in received:
            received += sock.recv(65536)
        sock.close()
        closed_at = time.monotonic()
        while time.monotonic() - closed_at < 5:
            if any(r.get("event") == "peer_closed" for r in slow.requests()):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the committed upstream stream kept running after the client left")
        assert time.monotonic() - closed_at < 1.0
    finally:
        slow.stop()


def test_broken_pool_file_stops_the_proxy_with_a_clear_message(tmp_path):
    import subprocess

    from harness import MITMDUMP, ROOT

    pool = tmp_path / "pool.yaml"
    pool.write_text("credentials:\n  - name: x\n    api_key_env: CODEX_FAILOVER_TEST_UNSET\n")
    proc = subprocess.run([MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(free_port()), "--set", f"confdir={tmp_path}",
                           "-s", str(ROOT / "addon" / "failover.py"), "--set", f"failover_config={pool}"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert f"pool file {pool}: credentials[0].api_key_env: environment variable CODEX_FAILOVER_TEST_UNSET" in proc.stdout + proc.stderr


def test_upstream_mode_is_refused_with_an_explanation(tmp_path):
    import subprocess

    from harness import MITMDUMP, ROOT

    proc = subprocess.run([MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(free_port()), "--set", f"confdir={tmp_path}",
                           "--mode", "upstream:http://127.0.0.1:9", "-s", str(ROOT / "addon" / "failover.py")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "does not work with --mode upstream" in proc.stdout + proc.stderr


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
def test_encrypted_reasoning_is_stripped_when_the_request_moves(fake, start_proxy, encoding):
    from conftest import WIRE

    body = (WIRE / "http" / "responses_request_body.json").read_bytes()
    headers = {}
    if encoding == "zstd":
        from mitmproxy.net.encoding import encode

        body, headers = encode(body, "zstd"), {"content-encoding": "zstd"}
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    assert b"Hello from sk-test-spare-good" in _raw_post(proxy.port, url(fake), "sk-test-client-overload", body, headers)
    client, spare = fake.model_requests()
    assert client["encrypted_reasoning"] == 1
    assert spare["encrypted_reasoning"] == 0
    assert spare["body_json"]
    assert spare["input_items"] == client["input_items"]


def test_previous_response_id_never_moves(fake, start_proxy):
    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], cooldown_wait="1s")
    body = json.dumps({"stream": True, "previous_response_id": "resp_1", "input": []})
    reply = post_responses(proxy.port, url(fake), "sk-test-client-overload", body=json.loads(body))
    assert reply.status == 503
    assert "previous_response_id" in reply.json()["error"]["not_moved_because"]
    assert {r["credential"] for r in fake.model_requests()} == {"sk-test-client-overload"}
    assert len(fake.model_requests()) == 3  # retried on its own credential: 0.5 s, then 1 s backoff
    assert "stays on its own credential" in proxy.log()


def test_session_sticks_to_its_credential_and_moves_on_failover(fake, start_proxy):
    proxy = start_proxy(fake, [("a", "sk-test-a-good"), ("b", "sk-test-b-good")], use_client_credential=False,
                        overload_cooldown="1s")

    def turn(session):
        reply = post_responses(proxy.port, url(fake), "sk-test-client-good", headers={"session-id": session})
        assert reply.status == 200
        return reply.body.decode().split("Hello from ", 1)[1].split(".", 1)[0]

    assert turn("s1") == "sk-test-a-good"
    assert turn("s2") == "sk-test-a-good"
    fake.overload_next("sk-test-a-good")
    assert turn("s1") == "sk-test-b-good"  # failover: s1 now lives on b
    time.sleep(1.1)  # a has recovered
    assert turn("s1") == "sk-test-b-good"  # stays on b: its prompt cache is there
    assert turn("s2") == "sk-test-a-good"  # s2 never moved
    assert turn("s3") == "sk-test-a-good"  # a new session: the policy's first choice


def test_expired_chatgpt_token_is_skipped_and_never_sent(fake, tmp_path):
    import base64

    def jwt(claims):
        enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
        return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"

    auth = {"expired": time.time() - 60, "fresh": time.time() + 3600}
    lines = ["credentials:"]
    for name, exp in auth.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens": {"access_token": jwt({"exp": exp}), "account_id": f"acct-{name}-good"}}))
        lines += [f"  - name: {name}", f"    auth_file: {path}", f"    base_url: {fake.base}/v1"]
    proxy = ProxyProcess(tmp_path, "\n".join(lines) + "\n")
    try:
        reply = post_responses(proxy.port, url(fake), jwt({"exp": time.time() + 60}),
                               headers={"chatgpt-account-id": "acct-client-overload"})
        assert reply.status == 200, reply.body[:300]
        assert "Hello from acct-fresh-good" in reply.body.decode()
        assert [r["credential"] for r in fake.model_requests()] == ["acct-client-overload", "acct-fresh-good"]
        assert "credential expired: its ChatGPT access token expired" in proxy.log()
    finally:
        proxy.stop()


def test_auth_file_rewritten_on_disk_brings_its_credential_back(fake, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"OPENAI_API_KEY": "sk-test-work-unauthorized"}))
    proxy = ProxyProcess(tmp_path, f"credentials:\n  - {{name: work, auth_file: {path}, base_url: {fake.base}/v1}}\n")
    try:
        assert post_responses(proxy.port, url(fake), "sk-test-client-overload").status == 503
        assert "taken out of rotation" in proxy.log()
        path.write_text(json.dumps({"OPENAI_API_KEY": "sk-test-work-good"}))  # the user logged in again
        time.sleep(1.1)  # the addon looks at auth files at most once a second
        reply = post_responses(proxy.port, url(fake), "sk-test-client-overload")
        assert reply.status == 200, reply.body[:300]
        assert "Hello from sk-test-work-good" in reply.body.decode()
        assert "credential work: auth file changed on disk; reloaded, in rotation" in proxy.log()
    finally:
        proxy.stop()


def test_encrypted_reasoning_pinned_by_policy_stays(fake, start_proxy):
    from conftest import WIRE

    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")], encrypted_reasoning="pin", cooldown_wait="0")
    body = (WIRE / "http" / "responses_request_body.json").read_bytes()
    data = _raw_post(proxy.port, url(fake), "sk-test-client-overload", body, {})
    assert b"encrypted reasoning and encrypted_reasoning is pin" in data
    assert [r["credential"] for r in fake.model_requests()] == ["sk-test-client-overload"]


def test_full_rate_limit_window_cools_the_credential(fake, start_proxy):
    proxy = start_proxy(fake, [("full", "sk-test-full-window-full"), ("other", "sk-test-other-good")],
                        use_client_credential=False)
    first = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert first.status == 200, first.body[:300]
    assert "Hello from sk-test-full-window-full" in first.body.decode()  # served, then full
    second = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert "Hello from sk-test-other-good" in second.body.decode()
    assert [r["credential"] for r in fake.model_requests()] == ["sk-test-full-window-full", "sk-test-other-good"]
