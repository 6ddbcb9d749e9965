"""End to end: the first attempt on the client's own credential rides the client's own connection
(mitm/direct.py). Upstream it is the request the client sent (its own credential, no
Proxy-Authorization), sequential requests on one client connection share one upstream connection as
through plain mitmdump, and what `-w` saves is the client's flow and the attempt's record, secret-free."""

from __future__ import annotations

import http.client
import json

import pytest
from harness import FakeUpstreamProcess, ProxyProcess, pool_yaml, proxy_status
from mitmproxy import io

pytestmark = pytest.mark.e2e

CLIENT_KEY = "sk-proj-DIRECTSECRET7-good"  # not echoed by the fake: any trace of it is a leak


def post(conn: http.client.HTTPConnection, url: str, key: str, extra: dict | None = None) -> bytes:
    body = json.dumps({"model": "gpt-fake", "stream": True, "input": [], "store": False})
    conn.request("POST", url, body=body, headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                                                  "accept": "text/event-stream", **(extra or {})})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200, data[:300]
    return data


@pytest.mark.parametrize("direct", [True, False])
def test_the_first_attempt_rides_the_clients_connection_and_is_saved_as_the_clients_flow(tmp_path, direct):
    fake = FakeUpstreamProcess(tmp_path)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path / "proxy", text, env,
                         extra=["-w", str(saved), "--set", f"failover_direct={str(direct).lower()}"])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=15)
        url = f"{fake.base}/v1/responses"
        for _ in range(3):  # one kept-alive client connection
            assert b"response.completed" in post(conn, url, CLIENT_KEY, {"proxy-authorization": "Basic dXNlcjpwdw=="})
        conn.close()
        report = proxy_status(proxy.port)
    finally:
        proxy.stop()
        fake.stop()
    models = fake.model_requests()
    assert len(models) == 3 and not any(r["proxy_authorization"] for r in models)
    assert len({r["conn"] for r in models}) == 1  # one upstream connection for the three
    # The addon's kept connections: only the spare's, dialled ahead of a failover, when attempt 1 is direct.
    assert report["upstream_dials"] == 1 if direct else report["upstream_dials"] >= 1
    data = saved.read_bytes()
    assert CLIENT_KEY.encode() not in data and b"dXNlcjpwdw" not in data
    with open(saved, "rb") as fh:
        flows = list(io.FlowReader(fh).stream())
    clients = [f for f in flows if not f.is_replay and f.request.path.endswith("/responses")]  # (not the status page)
    attempts = [f for f in flows if f.is_replay]
    # A served direct attempt's record is the client's own flow (it carried the attempt); over a kept
    # connection each attempt is a flow of its own.
    assert len(clients) == 3 and len(attempts) == (0 if direct else 3)
    for flow in attempts or clients:
        assert flow.marked == ":white_check_mark:", flow.comment
        assert "attempt 1/2: client via direct: commit (output)" in flow.comment or (
            direct and "attempt 1: client via direct: commit (output)" in flow.comment), flow.comment
        assert flow.request.headers["authorization"] == "<redacted by codex-failover>"
        # (the client's flow shows what the client sent: its credential for this proxy, redacted)
        assert flow.request.headers.get("proxy-authorization") == ("<redacted by codex-failover>" if direct else None)
        assert flow.response.status_code == 200 and b"response.created" in flow.response.raw_content
        assert flow.error is None
    for flow in clients:
        assert flow.response.status_code == 200 and b"response.completed" in (flow.response.raw_content or b"")
        assert bool(flow.marked) == direct  # the client's flow is marked when it carried the serving attempt


def test_a_direct_attempt_that_is_overloaded_in_stream_fails_over_and_the_client_sees_only_the_spare(tmp_path):
    fake = FakeUpstreamProcess(tmp_path)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["-w", str(saved)])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=15)
        url = f"{fake.base}/v1/responses"
        first = post(conn, url, "sk-test-client-overload")
        second = post(conn, url, "sk-test-client-good")  # the same client connection, after a failover
        conn.close()
    finally:
        proxy.stop()
        fake.stop()
    assert b"server_is_overloaded" not in first and b"response.completed" in first
    assert b"response.completed" in second
    with open(saved, "rb") as fh:
        flows = list(io.FlowReader(fh).stream())
    marks = [(f.marked, f.comment.splitlines()[0]) for f in flows if f.is_replay]
    assert (":x:", marks[0][1]) == marks[0] and "attempt 1/2: client via direct: failover (overloaded)" in marks[0][1]
    assert marks[1][0] == ":white_check_mark:" and "attempt 2/2: spare via direct: commit" in marks[1][1]
    loser = next(f for f in flows if f.is_replay and f.marked == ":x:")
    assert b"server_is_overloaded" in loser.response.raw_content
    assert loser.error.msg == "codex-failover: rejected: overloaded"
