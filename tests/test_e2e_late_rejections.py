"""End to end: a hold that outlasts a slow rejection (docs/decisions.md#a-hold-that-outlasts-a-slow-rejection).

Scaled: bootstrap_timeout 0.3 s stands for 30 s, first_event_timeout 0.8 s for 60 s, and the fake's
rejection comes about 1 s after response.created (40 s in the incident it stands for), with only
keepalive comments before it. The hold goes on past bootstrap_timeout (Codex kept alive by the
heartbeat's keepalive events), the late overload moves to the spare, and the client gets the spare's
answer; an upstream that goes silent instead is moved at first_event_timeout."""

from __future__ import annotations

import pytest
from harness import FakeUpstreamProcess, post_responses

pytestmark = pytest.mark.e2e

SPARE = "sk-test-spare-good"
SCALED = {"bootstrap_timeout": "0.3s", "first_event_timeout": "0.8s", "max_hold": "10s"}


@pytest.fixture
def slow_fake(tmp_path):
    upstream = FakeUpstreamProcess(tmp_path, "--pace", "0.002", "--deltas", "8", "--stall", "1.0")
    yield upstream
    upstream.stop()


def kinds(reply) -> list[str]:
    return [e["type"] for e in reply.events()]


def test_an_overload_long_after_response_created_with_only_keepalives_moves(slow_fake, start_proxy):
    proxy = start_proxy(slow_fake, [("spare", SPARE)], **SCALED)
    reply = post_responses(proxy.port, f"{slow_fake.base}/v1/responses", "sk-test-client-late-overload")
    assert reply.status == 200, reply.body[:300]
    shown = [k for k in kinds(reply) if k != "keepalive"]
    assert "error" not in shown and "response.failed" not in shown, reply.body[-800:]
    assert shown[-1] == "response.completed", reply.body[-800:]
    assert f"Hello from {SPARE}".encode() in reply.body
    assert reply.headers.get("x-codex-failover-heartbeat") == "1"  # the client kept alive past bootstrap_timeout
    assert [r["credential"] for r in slow_fake.model_requests()] == ["sk-test-client-late-overload", SPARE]
    assert "verdict=failover reason=overloaded" in proxy.log()


def test_an_upstream_silent_past_first_event_timeout_moves(slow_fake, start_proxy):
    proxy = start_proxy(slow_fake, [("spare", SPARE)], bootstrap_timeout="0.3s", first_event_timeout="0.5s",
                        max_hold="10s")
    reply = post_responses(proxy.port, f"{slow_fake.base}/v1/responses", "sk-test-client-stall")
    assert reply.status == 200, reply.body[:300]
    assert f"Hello from {SPARE}".encode() in reply.body, reply.body[-800:]
    assert [k for k in kinds(reply) if k != "keepalive"].count("response.created") == 1, reply.body[:800]
    assert "reason=stalled_before_output" in proxy.log(), proxy.log()[-3000:]
