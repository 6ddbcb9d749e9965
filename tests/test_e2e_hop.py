"""End to end: the held flow's hop (mitm/held_stream.py). Its head and first output leave in one write.
Its hooks run as mitmproxy runs every flow's hooks: when one awaits (an async addon, a flow
intercepted in mitmweb), the answer still arrives whole, also through a CONNECT tunnel (Codex's way
with HTTPS_PROXY)."""

from __future__ import annotations

import json

import pytest
from h2_client import H2Client
from harness import (
    ROOT,
    FakeUpstreamProcess,
    ProxyProcess,
    free_port,
    pool_yaml,
    post_responses,
    read_until,
    start_raw_post,
    wait_until,
)

pytestmark = pytest.mark.e2e

HOOKS = r'''
import asyncio, json, os

OUT = os.environ["HOOKS_OUT"]
MODE = os.environ["HOOKS_MODE"]


def _note(**what):
    with open(OUT, "a") as out:
        out.write(json.dumps(what) + "\n")


def _held(flow):
    return "codex_failover.hop" in flow.metadata


if MODE == "sync":
    def responseheaders(flow):
        if _held(flow):
            # Runs once the hook returned and the loop turned: has the first output been handed on?
            stream = flow.response.stream
            asyncio.get_running_loop().call_soon(lambda: _note(handed=len(getattr(stream, "data", b""))))
elif MODE == "async":
    async def responseheaders(flow):
        if _held(flow):
            await asyncio.sleep(0.05)
            _note(slept=True)
elif MODE == "writes":
    # Every write to the client's socket, as the transport gets it (plain HTTP/1.1: readable bytes).
    import asyncio.selector_events as _sel
    _write = _sel._SelectorSocketTransport.write

    def _spy(self, data):
        peer = self.get_extra_info("peername")
        if peer and peer[1] == int(os.environ["HOOKS_CLIENT_PORT"]):
            _note(write=bytes(data).decode("latin-1"))
        return _write(self, data)

    _sel._SelectorSocketTransport.write = _spy
elif MODE == "intercept":
    def responseheaders(flow):
        if _held(flow):
            flow.intercept()
            asyncio.get_running_loop().call_later(0.1, flow.resume)
            _note(intercepted=True)


async def response(flow):
    if "codex_failover.attempt" not in flow.metadata:  # the client's flow (its hop tag is gone by now)
        if MODE == "response_async":
            await asyncio.sleep(0.05)
        _note(response=flow.response.status_code)
'''


def start_proxy(tmp_path, base: str, mode: str, tls: bool = False) -> tuple[ProxyProcess, object]:
    """mitmdump with the addon, then a script of hooks (MODE `mode`); its notes go to the returned path."""
    script, out = tmp_path / "hooks.py", tmp_path / "hooks.jsonl"
    script.write_text(HOOKS)
    text, env = pool_yaml(base, [("spare", "sk-test-spare-good")])
    env = {**env, "HOOKS_OUT": str(out), "HOOKS_MODE": mode}
    extra = ["--set", "ssl_insecure=true"] if tls else []  # the fake's self-signed certificate
    proxy = ProxyProcess(tmp_path / "proxy", text, env, addon=False,
                         extra=[*extra, "-s", str(ROOT / "addon" / "failover.py"), "-s", str(script)])
    return proxy, out


def notes_in(out) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def run(fake, tmp_path, mode: str, tls: bool = False) -> tuple[list[dict], object]:
    proxy, out = start_proxy(tmp_path, fake.base, mode, tls)
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15,
                               ca=proxy.confdir / "mitmproxy-ca-cert.pem" if tls else None)
        assert "mitmproxy has crashed" not in proxy.log(), proxy.log()[-2000:]
    finally:
        proxy.stop()
    return notes_in(out), reply


@pytest.mark.parametrize("mode", ["async", "intercept", "response_async"])
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "connect"])
def test_a_held_flows_hook_that_awaits_still_gets_the_whole_answer(fake, tls_fake, tmp_path, mode, tunnel):
    """Through CONNECT the hook's end, coming down from the top, passes the tunnel's HttpLayer, which
    routes it by its own record of the command (a KeyError there crashed mitmproxy's handler and the
    client hung)."""
    notes, reply = run(tls_fake if tunnel else fake, tmp_path, mode, tls=tunnel)
    assert reply.status == 200, reply.body[:300]
    assert b"response.completed" in reply.body and not reply.truncated, reply.body[-300:]
    assert mode == "response_async" or {"slept": True} in notes or {"intercepted": True} in notes, notes
    assert {"response": 200} in notes, notes


def test_http2_held_streams_with_an_awaiting_hook_and_one_reset(tmp_path):
    """Three held streams on one HTTP/2 connection through CONNECT, a hook that awaits on each, one
    stream reset by the client mid-answer: the other two get their whole answers."""
    slow = FakeUpstreamProcess(tmp_path / "fake", "--tls", "--pace", "0.02", "--deltas", "30")  # ~0.7 s an answer
    proxy, _ = start_proxy(tmp_path, f"https://127.0.0.1:{slow.port}", "async", tls=True)
    client = None
    try:
        client = H2Client(proxy.port, f"127.0.0.1:{slow.port}", proxy.confdir / "mitmproxy-ca-cert.pem")
        a, b, c = (client.post_model("sk-test-client-good") for _ in range(3))
        wait_until(lambda: b.data, timeout=10, what="the second stream's answer to begin")
        client.reset(b)
        for stream in (a, c):
            client.wait(stream, timeout=15)
            assert stream.ended and stream.reset is None and b"response.completed" in stream.data, bytes(stream.data[-200:])
        assert "mitmproxy has crashed" not in proxy.log() and "Traceback" not in proxy.log(), proxy.log()[-2000:]
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        slow.stop()


def test_the_head_and_the_first_output_leave_in_one_write(fake, tmp_path):
    """The client wakes once, with the output it waits for: mitmproxy writes a head and a body chunk
    separately (the head a hook before), and the held stream joins them (StreamWire.keep_back)."""
    port = free_port()
    script, out = tmp_path / "hooks.py", tmp_path / "hooks.jsonl"
    script.write_text(HOOKS)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    env = {**env, "HOOKS_OUT": str(out), "HOOKS_MODE": "writes", "HOOKS_CLIENT_PORT": str(port)}
    proxy = ProxyProcess(tmp_path / "proxy", text, env, addon=False,
                         extra=["-s", str(ROOT / "addon" / "failover.py"), "-s", str(script)])
    try:
        with start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", 15, source_port=port) as sock:
            read_until(sock, b"response.completed")
    finally:
        proxy.stop()
    writes = [json.loads(line)["write"] for line in out.read_text().splitlines() if '"write"' in line]
    assert writes and writes[0].startswith("HTTP/1.1 200"), writes[:2]
    assert "reasoning_summary_text.delta" in writes[0], f"the head went out alone: {writes[0][:300]!r}"


WATCHER = r'''
import json, os

def update(flows):
    for flow in flows:
        # The held client flow once it has its answer (its hooks are mitmproxy's: `update` follows each).
        if "codex_failover.attempt" not in flow.metadata and flow.response is not None:
            with open(os.environ["HOOKS_OUT"], "a") as out:
                out.write(json.dumps({"update": flow.id}) + "\n")
'''


def test_a_script_that_gains_a_hook_while_mitmdump_runs_gets_it_on_the_held_flows(fake, tmp_path):
    """A script edited to implement `update` (nothing did before) gets it on held flows once
    mitmproxy reloaded it."""
    script, out = tmp_path / "watcher.py", tmp_path / "hooks.jsonl"
    script.write_text("# no hooks yet\n")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, {**env, "HOOKS_OUT": str(out)}, addon=False,
                         extra=["-s", str(ROOT / "addon" / "failover.py"), "-s", str(script)])
    try:
        first = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15)
        assert first.status == 200 and not notes_in(out)
        script.write_text(WATCHER)  # mitmproxy's ScriptLoader sees the change and reloads the script
        wait_until(lambda: proxy.log().count(f"Loading script {script}") >= 2, timeout=10, what="the reload")
        second = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15)
        assert second.status == 200 and b"response.completed" in second.body
        wait_until(lambda: notes_in(out), timeout=5, what="the held flow's update")
    finally:
        proxy.stop()


def test_with_proxy_debug_a_held_flows_hook_is_logged_by_every_layer_as_mitmproxy_logs_it(fake, tmp_path):
    """proxy_debug shows a command passing each layer; a hook ended in place would pass only its stream."""
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env,  # (the attempt on a kept connection: a handler of its own)
                         extra=["--set", "proxy_debug=true", "--set", "termlog_verbosity=debug", "--set", "failover_direct=false"])
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15)
        assert reply.status == 200 and b"response.completed" in reply.body
    finally:
        proxy.stop()
    for who in ("][127.0.0.1:", "] [warm "):  # the held client's connection; the attempt's kept one
        replies = [line for line in proxy.log().splitlines()
                   if who in line and ">> Reply(HttpResponseHeadersHook" in line]
        assert len({line.split(">>")[0].split("]")[-1] for line in replies}) >= 2, replies  # two depths or more
