#!/usr/bin/env python3
"""codex-failover, end to end and offline: the fake upstream, the proxy, and a client.

Scenario 1: the client's own key is overloaded in-stream (HTTP 200, `response.created`, then
`error`/`response.failed`); the first spare is overloaded too; the second spare answers. The
client sees one clean stream from the second spare. Scenario 2: every credential is overloaded:
the client gets a real 503 listing the attempts. Scenario 3: the same over Codex's WebSocket with
`failover_websocket=gate`: an overloaded first turn moves to the spare's socket, and the client sees
one clean turn.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import FakeUpstreamProcess, ProxyProcess, WsClient, pool_yaml, post_responses


def show_stream(reply) -> None:
    kinds = [e["type"] for e in reply.events()]
    text = "".join(e.get("delta", "") for e in reply.events() if e["type"] == "response.output_text.delta")
    print(f"  client got HTTP {reply.status}, {len(kinds)} events, first byte after {reply.first_byte_s * 1000:.0f} ms")
    print(f"  events: {kinds[0]} ... {kinds[-1]}; 'error' events: {kinds.count('error')}")
    print(f"  answer: {text[:60]}{'...' if len(text) > 60 else ''}")


def show_websocket_turn(proxy: ProxyProcess, fake: FakeUpstreamProcess) -> None:
    client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses", {"authorization": "Bearer sk-test-own-good"})
    client.send_json({"type": "response.create", "model": "gpt-fake", "stream": True, "input": []})
    events = client.recv_turn(30)
    client.close()
    kinds = [e["type"] for e in events]
    text = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
    print(f"  client got {len(kinds)} messages: {kinds[0]} ... {kinds[-1]}; 'error' messages: {kinds.count('error')}")
    print(f"  answer: {text[:60]}{'...' if len(text) > 60 else ''}")


def show_log(proxy: ProxyProcess, request_id: str) -> None:
    """The proxy's lines for `request_id` (r1, w1), whatever run prefix it has (`[k3x9-r1]`)."""
    for line in proxy.log().splitlines():
        if re.search(rf"\[(?:[0-9a-z]+-)?{request_id}\]", line):
            print("  proxy log:", re.sub(r"^\[[\d:.]+\]\s*", "", line))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fake = FakeUpstreamProcess(tmp, "--pace", "0.02", "--deltas", "12")
        proxy = None
        try:
            text, env = pool_yaml(fake.base, [("spare-1", "sk-test-spare1-overload"), ("spare-2", "sk-test-spare2-good")])
            print(f"fake upstream on 127.0.0.1:{fake.port}; pool file:\n" + "".join(f"  | {line}\n" for line in text.splitlines()))
            proxy = ProxyProcess(tmp, text, env)
            print(f"proxy (mitmdump -s addon/failover.py) on 127.0.0.1:{proxy.port}\n")

            print("1) own key overloaded, spare-1 overloaded, spare-2 healthy")
            show_stream(post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-own-overload"))
            show_log(proxy, "r1")
            print("  upstream saw:", ", ".join(f"{r['credential']} ({r['scenario']})" for r in fake.model_requests()))

            print("\n2) own key and the only spare overloaded")
            proxy.stop()
            text2, env2 = pool_yaml(fake.base, [("spare-1", "sk-test-spare1-overload")], max_retry_after="3s")
            (tmp / "p2").mkdir()
            proxy = ProxyProcess(tmp / "p2", text2, env2)
            started = time.monotonic()
            reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-own-overload")
            print(f"  client got HTTP {reply.status} after {(time.monotonic() - started) * 1000:.0f} ms, "
                  f"Retry-After: {reply.headers.get('retry-after')}")
            print("  body:", json.dumps(reply.json(), indent=None)[:400])
            show_log(proxy, "r1")

            print("\n3) the WebSocket, gated: the first turn is overloaded on primary, spare answers")
            proxy.stop()
            text3, env3 = pool_yaml(fake.base, [("primary", "sk-test-primary-overload"), ("spare", "sk-test-spare-good")],
                                    use_client_credential=False)
            (tmp / "p3").mkdir()
            proxy = ProxyProcess(tmp / "p3", text3, env3, extra=["--set", "failover_websocket=gate"])
            show_websocket_turn(proxy, fake)
            show_log(proxy, "w1")
        finally:
            if proxy:
                proxy.stop()
            fake.stop()


if __name__ == "__main__":
    main()
