"""End to end: the rejection shapes the real service answers with (tests/fixtures/wire/shapes), through a
real mitmdump with the addon. Pool only, the first credential answers the shape, the second is good."""

from __future__ import annotations

import pytest
from harness import WsClient, WsRejected, post_responses

pytestmark = pytest.mark.e2e

SPARE = "sk-test-spare-good"


def url(fake):
    return f"{fake.base}/v1/responses"


@pytest.mark.parametrize("scenario,reason", [
    ("overload-400", "overloaded"),   # HTTP 400 invalid_request_error, the overload said only in the message
    ("overload-msg", "overloaded"),   # HTTP 200 SSE: `error` and response.failed with only a message
    ("capacity-400", "capacity"),     # HTTP 400 "Selected model is at capacity", code null
    ("lb-503", "upstream_5xx"),       # a load balancer's HTML 503
])
def test_the_shape_fails_over_to_the_spare(fake, start_proxy, scenario, reason):
    proxy = start_proxy(fake, [("first", f"sk-test-first-{scenario}"), ("spare", SPARE)], use_client_credential=False)
    reply = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert reply.status == 200, reply.body[:300]
    kinds = [e["type"] for e in reply.events()]
    assert "error" not in kinds and "response.failed" not in kinds
    assert kinds[-1] == "response.completed"
    assert f"Hello from {SPARE}" in reply.body.decode()
    assert [r["credential"] for r in fake.model_requests()] == [f"sk-test-first-{scenario}", SPARE]
    assert f"reason={reason}" in proxy.log()


def test_a_real_400_is_not_moved(fake, start_proxy):
    proxy = start_proxy(fake, [("first", "sk-test-first-invalid"), ("spare", SPARE)], use_client_credential=False)
    reply = post_responses(proxy.port, url(fake), "sk-test-client-good")
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "invalid_value"
    assert [r["credential"] for r in fake.model_requests()] == ["sk-test-first-invalid"]


def test_a_websocket_error_message_saying_overloaded_fails_over(fake, start_proxy):
    proxy = start_proxy(fake, [("first", "sk-test-first-overload-msg"), ("spare", SPARE)],
                        extra=["--set", "failover_websocket=gate"], use_client_credential=False)
    headers = {"authorization": "Bearer sk-test-client-0", "openai-beta": "responses_websockets=2026-02-06",
               "session-id": "thread-1"}
    client = WsClient.connect(proxy.port, url(fake), headers)
    assert not isinstance(client, WsRejected), client
    client.send_json({"type": "response.create", "model": "gpt-fake", "stream": True, "store": False,
                      "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
    events = client.recv_turn(10.0)
    client.close()
    assert events[-1]["type"] == "response.completed"
    assert not any(e["type"] == "error" for e in events)
    assert f"Hello from {SPARE}" in "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
