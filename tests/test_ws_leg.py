"""A gated socket's flow (ws/leg.py): what it holds of the secrets, its messages and its verdicts,
without a running mitmproxy (no hooks run)."""

from __future__ import annotations

import asyncio

from mitmproxy.http import Headers
from mitmproxy.test import tflow

from codex_failover.mitm.attempt import PLACEHOLDER
from codex_failover.ws import leg as ws_leg


def make(headers: Headers) -> ws_leg.Leg:
    client = tflow.tflow()
    client.request.url = "https://api.openai.com/v1/responses"
    return ws_leg.Leg(client, "https://api.openai.com/v1/responses", headers, "w1#1", "socket 1: spare")


def test_the_flow_holds_placeholders_and_only_the_wire_has_the_values_in_order():
    leg = make(Headers([(b"Authorization", b"Bearer sk-proj-AAA"), (b"x-other", b"1"),
                        (b"cookie", b"a=SECRET1"), (b"cookie", b"b=SECRET2")]))
    shown = bytes(leg.flow.request.headers.fields.__repr__(), "utf-8")
    assert b"sk-proj-AAA" not in shown and b"SECRET" not in shown
    assert leg.flow.request.headers["authorization"] == PLACEHOLDER
    assert leg.wire_headers() == [(b"Authorization", b"Bearer sk-proj-AAA"), (b"x-other", b"1"),
                                  (b"cookie", b"a=SECRET1"), (b"cookie", b"b=SECRET2")]
    leg.flow.request.headers["x-added"] = PLACEHOLDER  # another addon's header: not a secret of ours
    assert (b"x-added", PLACEHOLDER.encode()) in leg.wire_headers()


def test_messages_past_the_bound_are_one_note_and_upstream_text_is_masked(monkeypatch):
    monkeypatch.setattr(ws_leg, "KEEP", 1000)
    leg = make(Headers(authorization="Bearer sk-proj-BBB"))

    async def run():
        await leg.accepted([])
        leg.message(b'{"error":"bad key sk-proj-BBB"}', True, False)
        for _ in range(500):
            leg.message(b"x" * 100, True, True)
        return leg.flow.websocket.messages

    messages = asyncio.run(run())
    assert b"sk-proj-BBB" not in messages[0].content
    assert len(messages) < 20  # the kept ones and one note, not 500
    assert messages[-1].content.startswith(b"(codex-failover: ")
    assert b"more message(s)" in messages[-1].content


def test_the_comment_keeps_its_title_and_the_last_verdicts():
    leg = make(Headers())

    async def run():
        for n in range(1, 121):
            leg.judge(":white_check_mark:", f"turn {n}: spare via direct: commit (output)")
        await asyncio.wait([leg._last])  # the updates it scheduled, in order

    asyncio.run(run())
    lines = leg.flow.comment.splitlines()
    assert lines[0] == "socket 1: spare" and lines[1] == "(70 earlier)"
    assert lines[2].startswith("turn 71:") and lines[-1].startswith("turn 120:") and len(lines) == 52


def test_mitmproxy_registers_every_hook_a_leg_runs_by_name():
    """The mitmproxy fact leg.py relies on: each hook class registers itself in `mitmproxy.hooks.all_hooks`
    under its name when mitmproxy's layers are imported (as mitmproxy imports them at start), and a
    flow hook's `args()` is the flow (update's, the list of flows)."""
    import mitmproxy.proxy.layers  # noqa: F401 - what a running mitmproxy has imported
    from mitmproxy import hooks

    flow = tflow.tflow()
    for name in ("requestheaders", "request", "responseheaders", "response", "error", "websocket_start",
                 "websocket_end"):
        assert hooks.all_hooks[name](flow).args() == [flow], name
    assert hooks.all_hooks["update"]([flow]).args() == [[flow]]
