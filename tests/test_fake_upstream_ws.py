"""The fake upstream's Responses-over-WebSocket transport, spoken to directly with the harness's WsClient."""

import time

import pytest
from harness import WsClient, WsRejected

CREATE = {"type": "response.create", "model": "gpt-fake", "input": [{"type": "message", "role": "user", "content": []}]}


@pytest.fixture
def connect(fake):
    clients = []

    def open_socket(token: str):
        client = WsClient.connect(None, fake.base + "/v1/responses", {"authorization": f"Bearer {token}"}, timeout=5)
        if isinstance(client, WsClient):
            clients.append(client)
        return client

    yield open_socket
    for client in clients:
        client.close()


def types(events):
    return [e["type"] for e in events]


def logged(fake, event, wait=2.0):
    end = time.monotonic() + wait
    while True:
        found = [r for r in fake.requests() if r.get("event") == event]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.02)


def test_a_good_turn_streams_the_events_in_order(fake, connect):
    ws = connect("sk-test-a-good")
    assert ws.headers["x-codex-turn-state"] == "ts-t-a-good"
    assert "openai-model" not in ws.headers
    ws.send_json(CREATE)
    events = ws.recv_turn()
    assert types(events)[:2] == ["response.created", "response.in_progress"]
    assert types(events)[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello from sk-test-a-good." + "".join(f" w{i}" for i in range(8))
    ws.close()
    handshake = next(r for r in fake.requests() if r.get("websocket"))
    assert handshake["method"] == "GET"
    assert handshake["scenario"] == "good"
    assert "authorization" in handshake["headers_seen"]
    (turn,) = logged(fake, "ws_turn")
    assert turn["turn"] == 1
    assert turn["input_items"] == 1
    assert turn["previous_response_id"] is None
    assert logged(fake, "ws_closed")[0]["code"] == 1000
    assert logged(fake, "ws_closed")[0]["by"] == "client"


def test_a_warmup_is_answered_without_output_and_can_be_continued(connect):
    ws = connect("sk-test-overload-w")  # the warm-up is answered whatever the credential's scenario
    ws.send_json({**CREATE, "generate": False})
    events = ws.recv_turn()
    assert types(events) == ["response.created", "response.completed"]
    assert events[-1]["response"]["output"] == []
    ws.send_json({**CREATE, "previous_response_id": events[0]["response"]["id"]})
    assert types(ws.recv_turn())[-1] == "error"  # the real turn is overloaded, not previous_response_not_found


def test_an_overloaded_turn_gets_a_503_error_and_the_socket_stays_open(connect):
    ws = connect("sk-test-overload-1")
    ws.send_json(CREATE)
    events = ws.recv_turn()
    assert types(events) == ["response.created", "error"]
    assert events[-1]["status"] == 503
    assert events[-1]["error"]["code"] == "server_is_overloaded"
    ws.send_ping()
    assert ws.recv() == ("pong", b"p")


def test_an_unknown_previous_response_id_is_not_found(fake, connect):
    ws = connect("sk-test-b-good")
    ws.send_json({**CREATE, "previous_response_id": "resp_from_another_socket"})
    (error,) = ws.recv_turn()
    assert error["status"] == 400
    assert error["error"]["code"] == "previous_response_not_found"
    assert logged(fake, "ws_turn")[0]["scenario"] == "previous_response_not_found"


def test_the_forced_queue_overloads_only_the_second_turn(fake, connect):
    ws = connect("sk-test-c-good")
    ws.send_json(CREATE)
    first = ws.recv_turn()
    assert types(first)[-1] == "response.completed"
    fake.overload_next("sk-test-c-good", 1)
    ws.send_json({**CREATE, "previous_response_id": first[-1]["response"]["id"]})
    assert ws.recv_turn()[-1]["status"] == 503
    ws.send_json(CREATE)
    assert types(ws.recv_turn())[-1] == "response.completed"
    assert [(t["turn"], t["scenario"]) for t in logged(fake, "ws_turn")] == [(1, "good"), (2, "overload"), (3, "good")]


def test_a_synchronous_scenario_rejects_the_upgrade(fake, connect):
    rejected = connect("sk-test-overload-503")
    assert isinstance(rejected, WsRejected)
    assert rejected.status == 503, rejected.body[:300]
    assert rejected.json()["error"]["code"] == "server_is_overloaded"
    fake.overload_next("sk-test-d-good", 1, "usage-limit")  # a forced synchronous scenario: the next handshake
    assert connect("sk-test-d-good").status == 429
    assert isinstance(connect("sk-test-d-good"), WsClient)


def test_many_deltas_arrive_in_order_exactly_once(fake, connect):
    ws = connect("sk-test-e-many")
    ws.send_json(CREATE)
    events = ws.recv_turn()
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [f"d{i} " for i in range(8)]
    assert types(events)[-1] == "response.completed"


def test_a_server_close_ends_the_socket_with_1011(fake, connect):
    ws = connect("sk-test-f-overload-close")
    ws.send_json(CREATE)
    events = ws.recv_turn()
    assert types(events) == ["response.created", "error"]
    assert "status" not in events[-1]
    assert ws.recv_turn() == [{"type": "__close__", "code": 1011, "reason": "server closing"}]
    assert logged(fake, "ws_closed")[0] | {"ts": 0} == {"ts": 0, "event": "ws_closed", "credential": "sk-test-f-overload-close",
                                                       "socket": 1, "code": 1011, "by": "server"}
