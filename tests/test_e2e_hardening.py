"""End to end: the proxy under slow, huge and hostile input (issue 14). Memory figures are RSS
read from /proc; each bound is stated next to its check."""

from __future__ import annotations

import socket
import time

import pytest
from harness import ROOT, FakeUpstreamProcess, ProxyProcess, pool_yaml, post_responses, start_raw_post, wait_until

pytestmark = pytest.mark.e2e


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_reads_nothing_does_not_make_the_proxy_buffer_the_stream(tmp_path):
    """200 MiB from a fast upstream to a client that reads nothing: the attempt stops reading
    (backpressure) and the proxy's RSS grows by at most 64 MiB (it grew by ~300 MB per such client)."""
    fake = FakeUpstreamProcess(tmp_path, "--flood-mib", "200")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    sock = None
    try:
        before = rss_mib(proxy.proc.pid)
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-flood")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.recv(4096)  # the response began: committed
        peak = before
        for _ in range(30):  # 3 s: unbounded buffering absorbed all 200 MiB in under 1 s
            time.sleep(0.1)
            peak = max(peak, rss_mib(proxy.proc.pid))
        assert peak - before <= 64, f"RSS grew by {peak - before:.0f} MiB"
        # The stream is intact once the client reads: a few MiB come through in order.
        sock.settimeout(10)
        got = 0
        while got < 8 * 1024 * 1024:
            chunk = sock.recv(1 << 20)
            assert chunk, "the stream ended early"
            got += len(chunk)
    finally:
        if sock is not None:
            sock.close()
        proxy.stop()
        fake.stop()


def test_an_http2_client_that_opens_no_window_does_not_make_the_proxy_buffer_the_stream(tmp_path):
    """The same over HTTP/2, where the client's socket keeps draining but the stream's flow-control
    window stays shut: mitmproxy's HTTP/2 layer would buffer everything it is handed, so the hop
    hands over no more past 1 MiB buffered (held_layer.H2_HIGH). It grew by ~200 MB before."""
    from h2_client import H2Client

    fake = FakeUpstreamProcess(tmp_path / "fake", "--tls", "--flood-mib", "200")
    text, env = pool_yaml(f"https://127.0.0.1:{fake.port}", [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", "ssl_insecure=true"])
    client = None
    try:
        before = rss_mib(proxy.proc.pid)
        client = H2Client(proxy.port, f"127.0.0.1:{fake.port}", proxy.confdir / "mitmproxy-ca-cert.pem", ack=False)
        stream = client.post_model("sk-test-client-flood")
        wait_until(lambda: stream.data, timeout=10, what="the response to begin")
        peak = before
        for _ in range(30):  # 3 s: unbounded buffering absorbed all 200 MiB in about 1 s
            time.sleep(0.1)
            peak = max(peak, rss_mib(proxy.proc.pid))
        assert peak - before <= 64, f"RSS grew by {peak - before:.0f} MiB"
        assert stream.reset is None
        assert not client.closed
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        fake.stop()


def test_response_timeout_below_connect_timeout_is_honoured(tmp_path):
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    text, env = pool_yaml(fake.base, [], response_timeout="1s", connect_timeout="10s")
    text = text.replace("credentials:\n", f"base_urls: [{fake.base}/v1]\ncredentials: []\n")
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        started = time.monotonic()
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-stall-headers", timeout=15)
        sock.settimeout(15)
        head = sock.recv(4096)
        took = time.monotonic() - started
        sock.close()
    finally:
        proxy.stop()
        fake.stop()
    assert head.startswith(b"HTTP/1.1 502"), head[:200]
    assert took < 4, f"answered after {took:.1f}s, response_timeout is 1s"


def status(port: int) -> dict:
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "http://codex-failover.status/")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def connect_status(sock: socket.socket, target: str, headers: str = "") -> bytes:
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{headers}\r\n".encode())
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head.split(b"\r\n", 1)[0]


def test_the_socks_bridge_serves_the_addon_only(fake, tmp_path):
    from harness import LocalProxies

    local = LocalProxies()
    try:
        socks = local.socks5("socks", users={"alice": "s3cret"})
        text, env = pool_yaml(fake.base, [("work", "sk-test-work-good", "tunnel")],
                              {"tunnel": [f"socks5://alice:s3cret@127.0.0.1:{socks}"]}, use_client_credential=False)
        proxy = ProxyProcess(tmp_path / "proxy", text, env)
        try:
            from harness import post_responses
            assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good").status == 200
            assert local.connections["socks"] == 1
            bridge = next(r["bridge_port"] for r in status(proxy.port)["routes"] if "bridge_port" in r)
            target = f"127.0.0.1:{fake.port}"
            with socket.create_connection(("127.0.0.1", bridge), timeout=10) as direct:  # any local process
                assert connect_status(direct, target) == b"HTTP/1.1 407 Proxy Authentication Required"
            with socket.create_connection(("127.0.0.1", bridge), timeout=10) as guessing:
                line = connect_status(guessing, target, "Proxy-Authorization: Basic Y29kZXgtZmFpbG92ZXI6eA==\r\n")
                assert line == b"HTTP/1.1 407 Proxy Authentication Required"
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as via_proxy:  # through the proxy
                assert connect_status(via_proxy, f"127.0.0.1:{bridge}") == b"HTTP/1.1 200 Connection established"
                assert connect_status(via_proxy, target) != b"HTTP/1.1 200 Connection established"
            assert local.connections["socks"] == 1, "the SOCKS server was touched for someone else"
        finally:
            proxy.stop()
    finally:
        local.close()


def test_a_runtime_pool_change_on_a_socks_route_uses_the_new_proxy_at_once(fake, tmp_path):
    from harness import LocalProxies, MitmwebProcess, post_responses

    local = LocalProxies()
    try:
        old = local.socks5("old", users={"alice": "old-pass"})
        new = local.socks5("new", users={"bob": "new-pass"})

        def pool(port, userinfo):
            return pool_yaml(fake.base, [("work", "sk-test-work-good", "tunnel")],
                             {"tunnel": [f"socks5://{userinfo}@127.0.0.1:{port}"]}, use_client_credential=False)

        text, env = pool(old, "alice:old-pass")
        web = MitmwebProcess(tmp_path / "web", text, env)
        try:
            url = f"{fake.base}/v1/responses"
            assert post_responses(web.port, url, "sk-test-client-good").status == 200
            changed = tmp_path / "changed.yaml"
            changed.write_text(pool(new, "bob:new-pass")[0])
            web.put("/options", {"failover_config": str(changed)})
            deadline = time.monotonic() + 5
            while "changed.yaml" not in web.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert post_responses(web.port, url, "sk-test-client-good").status == 200
            assert (local.connections["old"], local.connections["new"]) == (1, 1)
        finally:
            web.stop()
    finally:
        local.close()


def test_a_request_body_over_failover_max_body_passes_through_untouched(tmp_path):
    """A 43 MB body (300k reasoning items) is over the default 32 MiB: not held, so it costs what
    plain mitmdump costs (measured: +81 MB peak for 59 MB; held, it cost +345 MB)."""
    import json
    import threading

    fake = FakeUpstreamProcess(tmp_path)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    items = [{"type": "reasoning", "id": f"rs_{i}", "summary": [], "encrypted_content": "gAAAA" + "x" * 60}
             for i in range(300_000)]
    body = json.dumps({"model": "gpt-fake", "stream": True, "input": items}).encode()
    del items
    peak, base, done = [0.0], rss_mib(proxy.proc.pid), threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib(proxy.proc.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(f"POST {fake.base}/v1/responses HTTP/1.1\r\nHost: x\r\nauthorization: Bearer sk-test-client-good\r\n"
                         f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while b"response.completed" not in data:
                chunk = sock.recv(65536)
                assert chunk, data[-300:]
                data += chunk
    finally:
        done.set()
        watcher.join(5)
        proxy.stop()
        fake.stop()
    assert "over failover_max_body" in proxy.log(), proxy.log()[-2000:]
    assert "attempt 1/" not in proxy.log()
    assert len(fake.model_requests()) == 1
    growth = peak[0] - base
    assert growth <= 2.5 * len(body) / 2**20, f"+{growth:.0f} MiB for a {len(body) / 2**20:.0f} MiB body"


def test_the_gate_closes_a_socket_with_1009_on_a_message_over_the_limit(fake, tmp_path):
    from harness import WsClient, WsRejected

    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-2")], use_client_credential=False)
    proxy = ProxyProcess(tmp_path / "proxy", text, env,
                         extra=["--set", "failover_websocket=gate", "--set", "failover_max_body=1m"])
    try:
        client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses",
                                  {"authorization": "Bearer sk-test-client-0", "session-id": "thread-1"})
        assert not isinstance(client, WsRejected), client
        before = rss_mib(proxy.proc.pid)
        client.send_json({"type": "response.create", "model": "gpt-fake", "stream": True,
                          "input": [{"type": "message", "role": "user", "content": [
                              {"type": "input_text", "text": "x" * (4 * 1024 * 1024)}]}]})
        kind, *rest = client.recv(timeout=20)
        while kind not in ("close",):
            kind, *rest = client.recv(timeout=20)
        assert rest[0] == 1009, rest
        assert rss_mib(proxy.proc.pid) - before < 32
        assert not [r for r in fake.requests() if r.get("event") == "ws_turn"], "the message went upstream"
    finally:
        proxy.stop()


def test_an_http11_client_keeps_its_connection_across_held_requests(fake, tmp_path):
    import http.client
    import json

    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=15)
        body = json.dumps({"model": "gpt-fake", "stream": True, "input": []})
        socks = []
        for key in ("sk-test-client-overload", "sk-test-client-good", "sk-test-client-good"):
            conn.request("POST", f"{fake.base}/v1/responses", body=body,
                         headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            assert reply.status == 200, data[-500:]
            assert b"response.completed" in data
            assert (reply.getheader("connection") or "").lower() != "close"
            socks.append(conn.sock)
        conn.close()
        assert socks[0] is not None, "the client had to reconnect"
        assert socks[0] is socks[1] is socks[2], "the client had to reconnect"
    finally:
        proxy.stop()


def test_the_gate_takes_a_64_mib_message_whole(fake, tmp_path):
    """Under failover_max_body the gate passes a huge message on and the turn completes; memory stays
    a small multiple of the message (timings: docs/architecture.md, known limits)."""
    from harness import WsClient, WsRejected

    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-2")], use_client_credential=False)
    proxy = ProxyProcess(tmp_path / "proxy", text, env,
                         extra=["--set", "failover_websocket=gate", "--set", "failover_max_body=128m"])
    try:
        client = WsClient.connect(proxy.port, f"{fake.base}/v1/responses",
                                  {"authorization": "Bearer sk-test-client-0", "session-id": "thread-1"})
        assert not isinstance(client, WsRejected), client
        client.sock.settimeout(120)
        before = rss_mib(proxy.proc.pid)
        client.send_json({"type": "response.create", "model": "gpt-fake", "stream": True,
                          "input": [{"type": "message", "role": "user", "content": [
                              {"type": "input_text", "text": "x" * (64 * 1024 * 1024)}]}]})
        events = client.recv_turn(120)
        assert events[-1]["type"] == "response.completed", events[-1]
        assert rss_mib(proxy.proc.pid) - before < 5 * 64
    finally:
        proxy.stop()


def test_a_moved_attempt_carries_only_the_new_credentials_organization_and_project(fake, tmp_path):
    from harness import post_responses

    text = (f"credentials:\n"
            f"  - {{name: plain, api_key_env: KEY_P, base_url: {fake.base}/v1}}\n"
            f"  - {{name: org, api_key_env: KEY_O, base_url: {fake.base}/v1, organization: org-SPARE, "
            f"project: proj_SPARE}}\n")
    env = {"KEY_P": "sk-test-plain-overload", "KEY_O": "sk-test-org-good"}
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload",
                               headers={"OpenAI-Organization": "org-CLIENT", "OpenAI-Project": "proj_CLIENT"})
        assert reply.status == 200
    finally:
        proxy.stop()
    sent = [(r["credential"], r["account_headers"]) for r in fake.model_requests()]
    assert sent == [("sk-test-client-overload", {"openai-organization": "org-CLIENT", "openai-project": "proj_CLIENT"}),
                    ("sk-test-plain-overload", {}),
                    ("sk-test-org-good", {"openai-organization": "org-SPARE", "openai-project": "proj_SPARE"})], sent


TAP_STREAM = """
def request(flow):
    if not flow.is_replay:
        flow.request.stream = lambda chunk: chunk.upper()  # harmless for the client flow: its body is in
"""


def test_a_stream_another_addon_sets_on_the_client_request_does_not_reach_the_attempts(fake, tmp_path):
    """Attempts are copies of the client's request without its `stream` (as Request.copy() makes
    them): otherwise each attempt's body would be streamed through the other addon's callable."""
    tap = tmp_path / "tap.py"
    tap.write_text(TAP_STREAM)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env, addon=False,
                         extra=["-s", str(tap), "-s", str(ROOT / "addon" / "failover.py")])
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good")
        assert reply.status == 200, reply.body[:300]
        sent = fake.model_requests()
        assert sent and all(r["body_json"] for r in sent), sent
    finally:
        proxy.stop()

