"""End to end: a held flow's own hooks on the hop (mitm/client_hop.py, hook_chain.start). When every
addon's `responseheaders` returns at once, the stream goes on in the same `server_event`: the first
output is written before the loop turns. When one awaits (an async addon, a flow intercepted in
mitmweb), the hook completes as mitmproxy completes it, and the answer still arrives whole."""

from __future__ import annotations

import json

import pytest

from harness import ROOT, ProxyProcess, pool_yaml, post_responses

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
elif MODE == "intercept":
    def responseheaders(flow):
        if _held(flow):
            flow.intercept()
            asyncio.get_running_loop().call_later(0.1, flow.resume)
            _note(intercepted=True)


def response(flow):
    if "codex_failover.attempt" not in flow.metadata:  # the client's flow (its hop tag is gone by now)
        _note(response=flow.response.status_code)
'''


def run(fake, tmp_path, mode: str) -> tuple[list[dict], object]:
    script, out = tmp_path / "hooks.py", tmp_path / "hooks.jsonl"
    script.write_text(HOOKS)
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    env = {**env, "HOOKS_OUT": str(out), "HOOKS_MODE": mode}
    proxy = ProxyProcess(tmp_path / "proxy", text, env, addon=False,
                         extra=["-s", str(ROOT / "addon" / "failover.py"), "-s", str(script)])
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15)
    finally:
        proxy.stop()
    notes = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return notes, reply


def test_the_first_output_is_written_in_the_loop_turn_of_the_held_flows_responseheaders(fake, tmp_path):
    """With mitmproxy's own completion the stream waited one loop turn for the `server_event` lock,
    so a callback the hook scheduled ran before the first output was handed on (handed == 0)."""
    notes, reply = run(fake, tmp_path, "sync")
    assert reply.status == 200 and b"response.completed" in reply.body, reply.body[:300]
    handed = [n["handed"] for n in notes if "handed" in n]
    assert handed and handed[0] > 0, notes


@pytest.mark.parametrize("mode", ["async", "intercept"])
def test_a_held_flows_responseheaders_that_awaits_still_gets_the_whole_answer(fake, tmp_path, mode):
    notes, reply = run(fake, tmp_path, mode)
    assert reply.status == 200, reply.body[:300]
    assert b"response.completed" in reply.body and not reply.truncated, reply.body[-300:]
    assert {"slept": True} in notes or {"intercepted": True} in notes, notes
    assert {"response": 200} in notes, notes
