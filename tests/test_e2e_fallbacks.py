"""Each fallback of the seam (mitm/fallbacks.py), forced at start with CODEX_FAILOVER_FALLBACK as a
mitmproxy the seam does not know would choose it: the proxy starts, says which fallback is in use in
one line, and a failover still works end to end (the client's own credential overloaded in-stream,
the spare's answer delivered whole, no secret in the log)."""

from __future__ import annotations

import pytest
from harness import ProxyProcess, pool_yaml, post_responses


# (wsleg is the gated WebSocket's: its failover on the fallback is in tests/test_e2e_websocket.py's
# BOTH_STACKS cases; here, that it starts with its one line and leaves HTTP's failover as it is.)
@pytest.mark.parametrize("forced", ["hooks", "hop", "goaway", "wsleg", "engine", "hooks,hop,goaway,engine"])
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
        assert "CODEX_FAILOVER_FALLBACK: unknown name(s) enigne (known: hooks, hop, goaway, wsleg, engine)" in proxy.log()
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
        why = f"mitmproxy {release} is not a release the seam was tested on (12.0.0 to 12.3.1)"
        for name in ("hooks", "hop", "goaway", "wsleg", "engine"):
            assert f"codex-failover: {name}: " in log, log[-2000:]
        assert log.count(why) == 5, log[-2000:]
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
