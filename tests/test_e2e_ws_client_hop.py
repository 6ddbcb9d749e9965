"""End to end: a gated WebSocket's client side is answered in its own layers (mitm/held_stream.py's
101, ws/client_pipe.py), not through the loopback relay; the relay stays as the `hop` fallback.

A recording script logs every server connection the proxy opens: in process, none goes to the
relay on 127.0.0.1; with the fallback forced, one does, and the same moved turn still arrives."""

from __future__ import annotations

import json
import time

import pytest
from harness import WsClient, WsRejected, wait_until
from mitmproxy import io

pytestmark = pytest.mark.e2e

RECORDER = r'''
import json, os

def server_connected(data):
    with open(os.environ["SERVERS_OUT"], "a") as out:
        out.write(json.dumps({"address": list(data.server.address or ())}) + "\n")
'''
PRIMARY, SPARE = "sk-test-overload-1", "sk-test-spare-2"
CREATE = {"type": "response.create", "model": "gpt-fake", "stream": True, "store": False,
          "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
HEADERS = {"authorization": "Bearer sk-test-client-0", "openai-beta": "responses_websockets=2026-02-06",
           "session-id": "thread-1"}


def gated(start_proxy, fake, tmp_path, env=None):
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    out = tmp_path / "servers.jsonl"
    out.touch()
    saved = tmp_path / "flows.mitm"
    proxy = start_proxy(fake, [("primary", PRIMARY), ("spare", SPARE)], use_client_credential=False,
                        extra=["--set", "failover_websocket=gate", "-s", str(script), "-w", str(saved)],
                        env_extra={"SERVERS_OUT": str(out), **(env or {})})
    return proxy, out, saved


def moved_turn(proxy, fake) -> tuple[WsClient, list[dict]]:
    client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS)
    assert not isinstance(client, WsRejected), client
    client.send_json(CREATE)
    events = client.recv_turn(10.0)
    return client, events


def relay_connections(out, fake) -> list[list]:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [r["address"] for r in rows if r["address"] and r["address"][0] == "127.0.0.1"
            and r["address"][1] != fake.port]


@pytest.mark.parametrize("fallback", [False, True], ids=["in-process", "relay"])
def test_a_gated_socket_is_answered_in_its_own_layers_and_the_relay_is_the_fallback(start_proxy, fake, tmp_path,
                                                                                     fallback):
    proxy, out, saved = gated(start_proxy, fake, tmp_path, {"CODEX_FAILOVER_FALLBACK": "hop"} if fallback else None)
    client, events = moved_turn(proxy, fake)
    text = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["type"] == "response.completed" and SPARE in text, events
    assert [e["type"] for e in events].count("response.created") == 1  # only the winner's
    client.close(1000)
    wait_until(lambda: "websocket ended after" in proxy.log(), 10, "the session's end line")
    assert bool(relay_connections(out, fake)) is fallback, out.read_text()
    log = proxy.log()
    assert "moved to spare" in log and "sk-test-" not in log
    proxy.stop()
    with open(saved, "rb") as fh:
        client_flows = [f for f in io.FlowReader(fh).stream() if f.websocket is not None and not f.is_replay]
    assert len(client_flows) == 1
    flow = client_flows[0]
    assert flow.request.host == "127.0.0.1" and flow.request.port == fake.port  # its real URL, not the relay's
    assert flow.response.status_code == 101
    assert "sk-test-client-0" not in json.dumps(flow.get_state(), default=repr)
    kinds = [json.loads(m.content).get("type") for m in flow.websocket.messages if not m.from_client]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed", kinds
    assert flow.websocket.close_code == 1000


# --- what an adversarial review found (each fails on the change's first version) -----------------

PROBE = r'''
import asyncio, os
from mitmproxy import ctx, http
from codex_failover.mitm import held_stream

MODE = os.environ.get("PROBE_MODE", "")
held_stream.UNCLAIMED_TTL = 1.0  # how long a held stream waits for its stream to ask for it (30 s in use)
CLIENT_FLOWS = []


def websocket_start(flow):
    if not flow.is_replay:
        CLIENT_FLOWS.append(flow)


def request(flow):
    if flow.request.pretty_host == "probe.inject":
        ctx.master.commands.call("inject.websocket", CLIENT_FLOWS[-1], True, b'{"type":"probe.injected"}', True)
        flow.response = http.Response.make(200, b"injected")
    elif flow.request.headers.get("upgrade", "").lower() == "websocket" and not flow.is_replay:
        if MODE == "kill":
            flow.kill()
        elif MODE == "intercept":  # as mitmweb's intercept does, resumed by the user later
            flow.intercept()
            asyncio.get_running_loop().call_later(2.5, flow.resume)
'''


def probed(start_proxy, fake, tmp_path, mode="", **policy):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return start_proxy(fake, [("primary", "sk-test-primary-1")], use_client_credential=False,
                       extra=["--set", "failover_websocket=gate", "-s", str(script), *policy.pop("extra", [])],
                       env_extra={"PROBE_MODE": mode}, **policy)


def test_a_message_injected_into_a_gated_client_flow_reaches_the_client(start_proxy, fake, tmp_path):
    from harness import request

    proxy = probed(start_proxy, fake, tmp_path)
    client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS)
    client.send_json(CREATE)
    assert client.recv_turn(10)[-1]["type"] == "response.completed"
    assert request(proxy.port, "GET", "http://probe.inject/").status == 200
    assert client.recv(5) == ("text", '{"type":"probe.injected"}')
    client.send_json(CREATE)  # the socket goes on
    assert client.recv_turn(10)[-1]["type"] == "response.completed"
    assert "crashed" not in proxy.log()


def test_an_upgrade_another_addon_kills_ends_its_session_at_once(start_proxy, fake, tmp_path):
    from harness import proxy_status

    proxy = probed(start_proxy, fake, tmp_path, "kill")
    with pytest.raises(ConnectionError):  # mitmproxy closes a killed flow's connection
        WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS)
    wait_until(lambda: proxy_status(proxy.port)["websockets"] == [], 0.9, "the session's end, before the hop's wait")
    time.sleep(1.5)
    assert "never reached its answer" not in proxy.log()


def test_an_upgrade_resumed_after_its_hop_gave_up_is_refused_never_sent_with_placeholders(start_proxy, fake, tmp_path):
    proxy = probed(start_proxy, fake, tmp_path, "intercept")
    rejected = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS, timeout=15)
    assert isinstance(rejected, WsRejected) and rejected.status == 502, rejected
    sockets = [r for r in fake.requests() if r.get("websocket")]
    assert [r["credential"] for r in sockets] == ["sk-test-primary-1"], sockets  # the gate's own, nothing after


def test_a_client_message_far_over_the_limit_closes_with_1009_both_ways(start_proxy, fake, tmp_path):
    proxy = probed(start_proxy, fake, tmp_path, extra=["--set", "failover_max_body=1m"])
    client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", HEADERS)
    text = "y" * (3 << 20)
    client.send_json({**CREATE, "input": [{"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": text}]}]})
    kind, *rest = client.recv(timeout=10)
    while kind != "close":
        kind, *rest = client.recv(timeout=10)
    assert rest[0] == 1009, rest
    wait_until(lambda: [r for r in fake.requests() if r.get("event") == "ws_closed"], 5, "the upstream's close")
    assert [r["code"] for r in fake.requests() if r.get("event") == "ws_closed"] == [1009]
