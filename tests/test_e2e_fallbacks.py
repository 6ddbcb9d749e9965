"""Each fallback of the seam (mitm/fallbacks.py), forced at start with CODEX_FAILOVER_FALLBACK as a
mitmproxy the seam does not know would choose it: the proxy starts, says which fallback is in use in
one line, and a failover still works end to end (the client's own credential overloaded in-stream,
the spare's answer delivered whole, no secret in the log)."""

from __future__ import annotations

import pytest
from harness import ProxyProcess, pool_yaml, post_responses


# (wsleg is the gated WebSocket's: its failover on the fallback is in tests/test_e2e_websocket.py's
# BOTH_STACKS cases; here, that it starts with its one line and leaves HTTP's failover as it is.)
@pytest.mark.parametrize("forced", ["hooks", "hop", "goaway", "wsleg", "hooks,hop,goaway"])
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
    proxy = ProxyProcess(tmp_path, text, {**env, "CODEX_FAILOVER_FALLBACK": "hop,engine"})
    try:
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good").status == 200
        assert "CODEX_FAILOVER_FALLBACK: unknown name(s) engine (known: hooks, hop, goaway, wsleg)" in proxy.log()
    finally:
        proxy.stop()


def test_an_untested_release_in_the_range_starts_on_every_fallback_and_still_fails_over(fake, tmp_path):
    """A mitmproxy inside pyproject's range that the contract tests were not run on (a later patch
    release, faked here before anything imports mitmproxy): one line per fallback, no refusal."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import mitmproxy.version\nmitmproxy.version.VERSION = '12.3.99'\n")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, {**env, "PYTHONPATH": str(site)})
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload")
        assert reply.status == 200 and "Hello from sk-test-spare-good" in reply.body.decode(), reply.body[-300:]
        log = proxy.log()
        why = "mitmproxy 12.3.99 is not a release the seam was tested on (12.0.0 to 12.3.1)"
        for name in ("hooks", "hop", "goaway", "wsleg"):
            assert f"codex-failover: {name}: " in log, log[-2000:]
        assert log.count(why) == 4, log[-2000:]
        assert "verdict=failover reason=overloaded" in log and "sk-test-" not in log
    finally:
        proxy.stop()
