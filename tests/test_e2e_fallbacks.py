"""Each fallback of the seam (mitm/fallbacks.py), forced at start with CODEX_FAILOVER_FALLBACK as a
mitmproxy the seam does not know would choose it: the proxy starts, says which fallback is in use in
one line, and a failover still works end to end (the client's own credential overloaded in-stream,
the spare's answer delivered whole, no secret in the log)."""

from __future__ import annotations

import pytest
from harness import ProxyProcess, pool_yaml, post_responses


# (wsleg is the gated WebSocket's: its failover on the fallback is in tests/test_e2e_websocket.py's
# BOTH_STACKS cases; here, that it starts with its one line and leaves HTTP's failover as it is.)
@pytest.mark.parametrize("forced", ["hop", "goaway", "wsleg", "engine", "hop,goaway,engine"])
def test_a_forced_fallback_still_fails_over(fake, tmp_path, forced):
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": forced})
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload")
        assert reply.status == 200, reply.body[-300:]
        kinds = [e["type"] for e in reply.events()]
        assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed", kinds
        assert "Hello from sk-test-spare-good" in reply.body.decode()
        log = proxy.log()
        for name in forced.split(","):
            assert f"codex-failover: {name}: " in log and "CODEX_FAILOVER_FALLBACK asks for it" in log, log[-2000:]
        assert "verdict=failover reason=overloaded" in log
        assert "sk-test-" not in log
    finally:
        proxy.stop()


def test_an_unknown_fallback_name_is_one_clear_line(fake, tmp_path):
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": "hop,enigne"})
    try:
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good").status == 200
        assert "CODEX_FAILOVER_FALLBACK: unknown name(s) enigne (known: hop, goaway, wsleg, engine)" in proxy.log()
    finally:
        proxy.stop()


@pytest.mark.parametrize("release", ["12.3.99", "12.5.0"])
def test_an_untested_mitmproxy_12_starts_on_every_fallback_and_still_fails_over(fake, tmp_path, release):
    """A mitmproxy 12 the contract tests were not run on (a later patch release inside pyproject's
    range, or a later minor one past it; faked before anything imports mitmproxy): one line per
    fallback, no refusal."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import mitmproxy.version\nmitmproxy.version.VERSION = {release!r}\n")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, "PYTHONPATH": str(site)})
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload")
        assert reply.status == 200 and "Hello from sk-test-spare-good" in reply.body.decode(), reply.body[-300:]
        log = proxy.log()
        why = (f"codex-failover: mitmproxy {release} is not a release the seam was tested on (12.0.0 to 12.3.1): "
               f"every part runs on mitmproxy's public API instead (hop, goaway, wsleg, engine; ")
        assert log.count(why) == 1, log[-2000:]  # one line says it all
        assert "codex-failover: hooks: " not in log
        assert "verdict=failover reason=overloaded" in log and "sk-test-" not in log
    finally:
        proxy.stop()


def test_the_engines_fallback_dials_each_attempt_itself_and_keeps_the_credential_off_its_flow(fake, tmp_path):
    """`engine`: no kept connection, so every attempt is a connection of its own (the fake's `conn`);
    the head on the wire carries the key, the saved attempt flows only the placeholder."""
    from mitmproxy import io

    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": "engine"}, extra=["-w", str(saved)])
    try:
        for _ in range(2):
            reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload")
            assert reply.status == 200 and "Hello from sk-test-spare-good" in reply.body.decode()
    finally:
        proxy.stop()
    model = [r for r in fake.requests() if r.get("path", "").endswith("/responses")]
    # (the second request skips the own key, cooling since the first)
    assert [r["credential"] for r in model] == ["sk-test-client-overload", "sk-test-spare-good", "sk-test-spare-good"]
    assert len({r["conn"] for r in model}) == 3  # a connection per attempt
    data = saved.read_bytes()
    assert b"sk-test-spare-good" not in data.replace(b"Hello from sk-test-spare-good", b"")
    assert b"Bearer sk-test-client-overload" not in data
    with open(saved, "rb") as fh:
        attempts = [f for f in io.FlowReader(fh).stream() if f.is_replay]
    assert len(attempts) == 3
    assert {f.request.headers["authorization"] for f in attempts} == {"<redacted by codex-failover>"}
    assert [f.marked for f in attempts] == [":x:", ":white_check_mark:", ":white_check_mark:"], \
        [(f.marked, f.comment) for f in attempts]


# --- the engine's fallback against what a review found (each failed on its first version) ----------

ATTEMPT_SCRIPT = r'''
import os
from mitmproxy import http

MODE = os.environ["ATTEMPT_MODE"]


def request(flow):
    label = flow.metadata.get("codex_failover.attempt", "")
    if label.endswith("#1"):  # the first attempt (the client's own key)
        if MODE == "kill":
            flow.kill()
        elif MODE == "answer":
            flow.response = http.Response.make(503, b'{"error":{"type":"server_error","code":"server_is_overloaded",'
                                                    b'"message":"answered by a script"}}',
                                               {"content-type": "application/json"})
'''


@pytest.mark.parametrize("mode, line", [
    ("kill", "verdict=failed reason=ambiguous"),  # as on the kept connections: a kill is not known to be safe to replay
    ("answer", "verdict=failover reason=overloaded status=503"),
])
def test_on_the_engines_fallback_an_attempt_another_addon_kills_or_answers_ends_at_once(fake, tmp_path, mode, line):
    import time

    script = tmp_path / "attempts.py"
    script.write_text(ATTEMPT_SCRIPT)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": "engine", "ATTEMPT_MODE": mode},
                         extra=["-s", str(script), "--set", "failover_direct=false"])  # (an attempt flow of its own)
    try:
        started = time.monotonic()
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good")
        assert time.monotonic() - started < 3, "the attempt hung until the connect timeout"
        log = proxy.log()
        assert f"attempt 1/2 credential=client route=direct {line}" in log, log[-2000:]
        if mode == "answer":
            assert reply.status == 200 and "Hello from sk-test-spare-good" in reply.body.decode()
        else:
            assert reply.status == 502
        assert "internal error" not in log
    finally:
        proxy.stop()


def test_on_the_engines_fallback_a_body_ended_by_the_close_is_read_whole(tmp_path):
    """An overload answered without a length, the connection closed after it (a load balancer's
    way): classified as on the kept connections, not as a cut answer."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    body = b'{"error":{"type":"server_error","code":"server_is_overloaded","message":"busy"}}'

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
                             + body)

    threading.Thread(target=serve, daemon=True).start()
    try:
        raw = f"http://127.0.0.1:{server.getsockname()[1]}"
        text, env = pool_yaml(raw, [("spare", "sk-test-spare-2")])
        proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": "engine"})
        try:
            reply = post_responses(proxy.port, f"{raw}/v1/responses", "sk-test-client-1")
            log = proxy.log()
            for cred in ("client", "spare"):
                assert f"credential={cred} route=direct verdict=failover reason=overloaded status=503" in log, log[-2000:]
            assert reply.status == 503, reply.body[-300:]
        finally:
            proxy.stop()
    finally:
        server.close()
