"""End to end: the real backend's SSE may carry no Content-Type (or a wrong one). A 2xx answer to a
streaming request is held, classified and streamed as SSE by what it is (core/codex_request.py
`held_as_stream`): its in-stream overload moves, and a healthy slow stream reaches the client as it
comes, not in one piece after it ended."""

from __future__ import annotations

import pytest
from harness import FakeUpstreamProcess, post_responses

pytestmark = pytest.mark.e2e


def url(fake) -> str:
    return f"{fake.base}/v1/responses"


def kinds(reply) -> list[str]:
    return [e["type"] for e in reply.events()]


@pytest.mark.parametrize("client", ["sk-test-client-noctype-overload", "sk-test-client-overload"])
@pytest.mark.parametrize("spare", ["sk-test-spare-noctype-good", "sk-test-spare-wrongtype-good"])
def test_an_unlabelled_in_stream_overload_moves_to_the_spare(fake, start_proxy, client, spare):
    proxy = start_proxy(fake, [("spare", spare)])
    reply = post_responses(proxy.port, url(fake), client)
    assert reply.status == 200, reply.body[:300]
    assert "error" not in kinds(reply) and "response.failed" not in kinds(reply), reply.body[:600]
    assert kinds(reply)[-1] == "response.completed", reply.body[-600:]
    assert f"Hello from {spare}".encode() in reply.body
    assert [r["credential"] for r in fake.model_requests()] == [client, spare]
    assert "verdict=failover reason=overloaded" in proxy.log()


@pytest.mark.parametrize("client,spare", [("sk-test-client-noctype-good", "sk-test-spare-good"),
                                          ("sk-test-client-overload", "sk-test-spare-noctype-good")],
                         ids=["direct", "moved"])
def test_a_healthy_unlabelled_stream_arrives_as_it_comes(tmp_path, start_proxy, client, spare):
    slow = FakeUpstreamProcess(tmp_path, "--pace", "0.05", "--deltas", "20")
    try:
        proxy = start_proxy(slow, [("spare", spare)])
        reply = post_responses(proxy.port, url(slow), client)
    finally:
        slow.stop()
    assert reply.status == 200, reply.body[:300]
    assert kinds(reply)[-1] == "response.completed", reply.body[-600:]
    assert len(reply.chunks) > 5, reply.chunks
    assert reply.first_byte_s < reply.chunks[-1][0] - 0.5  # streamed live, not buffered
