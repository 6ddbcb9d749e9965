"""End to end: opt-in full-stream recovery on the same credential and route."""

from __future__ import annotations

import threading
import time

import pytest
from harness import ProxyProcess, post_responses, proxy_status, start_raw_post, upstream_and_proxy

pytestmark = pytest.mark.e2e
CLIENT = "sk-test-client-good"



@pytest.fixture
def start(tmp_path, fake):
    procs = []

    def start_proxy(recovery: str = "", policy: str = "") -> ProxyProcess:
        text = (f"base_urls: [{fake.base}/v1]\n"
                f"recovery: {{enabled: true, retry_window: 5s, heartbeat: 0, backoff: {{initial: 10ms, max: 50ms}}"
                f"{recovery}}}\n"
                f"policy: {{cooldown_wait: 0s{policy}}}\n")
        proc = ProxyProcess(tmp_path, text)
        procs.append(proc)
        return proc

    yield start_proxy
    for proc in procs:
        proc.stop()


def call(proxy, fake, token=CLIENT):
    return post_responses(proxy.port, f"{fake.base}/v1/responses", token)


def kinds(reply):
    return [e["type"] for e in reply.events()]


def one_clean_response(reply, fake):
    """Exactly one complete response, byte for byte the one the upstream's last attempt sent."""
    import hashlib

    assert reply.status == 200
    types = kinds(reply)
    assert types.count("response.created") == 1
    assert types[-1] == "response.completed"
    assert "error" not in types
    assert "response.failed" not in types
    digest = hashlib.sha256(reply.body).hexdigest()
    assert fake.sent_digests(expect=digest)[-1] == digest


@pytest.mark.parametrize("fault", ["midstream-server-error", "cut", "http-502", "http-503", "http-504", "http-500"])
def test_transient_failure_recovers_on_the_same_credential(fake, start, fault):
    proxy = start()
    fake.overload_next(CLIENT, 2, fault)
    reply = call(proxy, fake)
    one_clean_response(reply, fake)
    assert [r["scenario"] for r in fake.model_requests()] == [fault, fault, "good"]
    assert "recovery:" in proxy.log()


@pytest.mark.parametrize("scenario,status", [("rate-429", 429), ("unauthorized", 401), ("invalid", 400)])
def test_final_answers_are_not_retried(fake, start, scenario, status):
    proxy = start()
    reply = call(proxy, fake, f"sk-test-client-{scenario}")
    assert reply.status == status, reply.body[:300]
    assert len(fake.model_requests()) == 1


def test_exhaustion_keeps_the_last_structured_error(fake, start):
    proxy = start(", attempts: 2")
    fake.overload_next(CLIENT, 10, "midstream-server-error")
    reply = call(proxy, fake)
    assert reply.status == 200, reply.body[:300]
    assert kinds(reply)[-1] == "response.failed"
    assert reply.events()[-1]["response"]["error"]["code"] == "server_error"
    assert kinds(reply).count("response.created") == 1  # only the final attempt's bytes
    assert len(fake.model_requests()) == 3


def test_exhausted_502_keeps_its_status_and_like_408_cools_nothing(fake, start):
    proxy = start(", attempts: 1")
    fake.overload_next(CLIENT, 2, "http-502")
    reply = call(proxy, fake)
    assert reply.status == 502, reply.body[:300]
    assert reply.json()["error"]["code"] == "bad_gateway"
    # A bare 5xx says nothing about the account, after recovery's retries as anywhere else
    # (docs/architecture.md#the-request-machine): the next request is dialled and served.
    before = len(fake.model_requests())
    assert call(proxy, fake).status == 200
    assert len(fake.model_requests()) == before + 1

    other = start(", attempts: 1")
    fake.overload_next("sk-test-other-good", 2, "cut")
    reply = call(other, fake, "sk-test-other-good")
    assert reply.status == 408, reply.body[:300]
    assert reply.json()["error"]["code"] == "stream_incomplete"
    assert call(other, fake, "sk-test-other-good").status == 200  # nothing cooled


def test_overflow_fails_open_with_every_byte_once(tmp_path):
    pool = lambda base: f"base_urls: [{base}/v1]\nrecovery: {{enabled: true, max_buffer_bytes: 64KiB}}\n"  # noqa: E731
    with upstream_and_proxy(tmp_path / "big", pool, "--pace", "0", "--deltas", "3000") as (big, proxy):
        reply = post_responses(proxy.port, f"{big.base}/v1/responses", CLIENT)
        one_clean_response(reply, big)
        assert len(reply.body) > 64 * 1024
        assert "streaming the rest live" in proxy.log()

def test_saturation_streams_normally(fake, start):
    proxy = start(", max_concurrent: 1")
    fake.overload_next("sk-test-slow-good", 1, "stall-after-output")
    def held():
        try:
            call(proxy, fake, "sk-test-slow-good")
        except OSError:
            pass  # the proxy stops before the 30 s stall ends

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while proxy_status(proxy.port)["recovery_buffering"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    reply = call(proxy, fake)  # the one slot is taken: this one streams live, never waits
    one_clean_response(reply, fake)
    assert proxy_status(proxy.port)["recovery_buffering"] == 1


def test_client_leaving_during_backoff_stops_everything(fake, start):
    import re

    proxy = start(", backoff: {initial: 3s, max: 3s}")
    # Full jitter may pick a short backoff; try until one is long enough to leave during it.
    for attempt in range(12):
        fake.overload_next(CLIENT, 1, "http-502")
        before = len(fake.model_requests())
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", CLIENT)
        deadline, delay = time.monotonic() + 5, None
        while delay is None and time.monotonic() < deadline:
            found = re.findall(rf"\[[0-9a-z]+-r{attempt + 1}\] recovery: .* retry 1 in (\d+) ms", proxy.log())
            delay = int(found[0]) if found else None
            time.sleep(0.01)
        sock.close()
        if delay is not None and delay >= 1000:
            break
        time.sleep(3.2)  # let this one finish
    else:
        pytest.fail("no backoff of 1 s or more in 12 tries")
    time.sleep(delay / 1000 + 0.5)  # past the backoff: had it gone on, the retry would have reached the fake
    assert [r["scenario"] for r in fake.model_requests()[before:]] == ["http-502"]
    assert proxy_status(proxy.port)["held_requests"] == 0
    assert call(proxy, fake).status == 200  # and nothing cooled


def test_client_leaving_during_buffering_stops_everything(fake, start):
    proxy = start()
    fake.overload_next(CLIENT, 1, "stall-after-output")
    sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", CLIENT)
    deadline = time.monotonic() + 5
    while proxy_status(proxy.port)["recovery_buffering"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()
    time.sleep(1.0)
    assert any(r.get("event") == "peer_closed" for r in fake.requests())
    assert len(fake.model_requests()) == 1  # no further attempt
    assert proxy_status(proxy.port)["recovery_buffering"] == 0
    assert call(proxy, fake).status == 200  # and nothing cooled


def test_heartbeat_keeps_an_idle_client_alive_then_delivers_the_winner(tmp_path):
    import hashlib

    pool = lambda base: f"base_urls: [{base}/v1]\nrecovery: {{enabled: true, heartbeat: 1s}}\n"  # noqa: E731
    with upstream_and_proxy(tmp_path / "hb", pool, "--pace", "0.002", "--deltas", "8", "--stall", "2.5") as (slow, proxy):
        slow.overload_next(CLIENT, 1, "stall-after-output")
        reply = post_responses(proxy.port, f"{slow.base}/v1/responses", CLIENT)
        beat = b'event: keepalive\ndata: {"type":"keepalive"}\n\n'
        sent = slow.sent_digests(expect=hashlib.sha256(reply.body.replace(beat, b"")).hexdigest())
    assert reply.status == 200, reply.body[:300]
    assert reply.headers.get("x-codex-failover-heartbeat") == "1"
    assert reply.body.count(beat) >= 2
    assert reply.first_byte_s < 2.0  # alive while buffering
    assert hashlib.sha256(reply.body.replace(beat, b"")).hexdigest() == sent[-1]  # then the winner, in full

def test_heartbeat_mode_delivers_exhaustion_in_stream(fake, start):
    proxy = start(", attempts: 1, heartbeat: 1s")
    fake.overload_next(CLIENT, 2, "cut")
    reply = call(proxy, fake)
    assert reply.status == 200
    last = reply.events()[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["error"]["status"] == 408
    assert len(fake.model_requests()) == 2


def test_a_fast_complete_answer_is_not_retried(tmp_path):
    """The deciding event and response.completed may arrive in one read: still one complete answer."""
    pool = lambda base: f"base_urls: [{base}/v1]\nrecovery: {{enabled: true, heartbeat: 0}}\n"  # noqa: E731
    with upstream_and_proxy(tmp_path / "fast", pool, "--pace", "0", "--deltas", "3") as (fast, proxy):
        for _ in range(5):
            reply = post_responses(proxy.port, f"{fast.base}/v1/responses", "sk-test-client-burst")
            one_clean_response(reply, fast)
        assert len(fast.model_requests()) == 5
