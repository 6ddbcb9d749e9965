"""A gated socket's flow (ws/leg.py): what it holds of the secrets, its messages and its verdicts,
without a running mitmproxy (no hooks run)."""

from __future__ import annotations

import asyncio

from mitmproxy.http import Headers
from mitmproxy.test import taddons, tflow

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
            leg.judge_socket(":white_check_mark:", f"turn {n}: spare via direct: commit (output)")
        await leg.record.settled()  # the updates it scheduled, in order

    asyncio.run(run())
    lines = leg.flow.comment.splitlines()
    assert lines[0] == "socket 1: spare" and lines[1] == "(70 earlier)"
    assert lines[2].startswith("• turn 71:") and lines[-1].startswith("• turn 120:") and len(lines) == 52


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


def test_a_finished_leg_is_freed_without_the_garbage_collector():
    """No reference cycle holds a leg (and the session dialling it) once it is done: a gated session is
    freed by reference counting (mitmproxy's type check of a `None` field used to leave one)."""
    import gc
    import weakref

    class Marker:
        pass

    client = tflow.tflow()  # (the test helper itself leaves cycles: made before the count)
    client.request.url = "https://api.openai.com/v1/responses"

    async def dial():
        marker = Marker()
        leg = ws_leg.Leg(client, "https://api.openai.com/v1/responses", Headers(authorization="Bearer sk-proj-CCC"),
                         "w1#1", "socket 1")
        await leg.accepted([(b"x-models-etag", b"1")])
        other = ws_leg.Leg(client, "https://api.openai.com/v1/responses", Headers(), "w1#2", "socket 2")
        await other.rejected(503, [], b"busy", "upgrade rejected")
        await other.failed("boom", "upgrade failed")
        return weakref.ref(marker), weakref.ref(leg)

    # Its own master: mitmproxy's `ctx.master` is whichever master was made last, and an earlier test's may
    # hold an addon that raises; its logged traceback (kept by pytest's log capture) holds the frames that
    # called it, this coroutine's with them, and so the marker (the test failed so, depending on the order).
    with taddons.context():
        gc.disable()
        try:
            marker, leg = asyncio.run(dial())
            assert marker() is None and leg() is None
        finally:
            gc.enable()


def test_a_secret_header_another_addon_set_goes_to_the_wire_only_and_never_proxy_authorization():
    leg = make(Headers(authorization="Bearer sk-proj-DDD"))
    leg.flow.request.headers["authorization"] = "Bearer sk-proj-ADDONSECRET9"  # modify_headers, upstream_auth
    leg.flow.request.headers["proxy-authorization"] = "Basic cHJveHk6c2VjcmV0"
    leg._hide_added()
    assert leg.flow.request.headers["authorization"] == PLACEHOLDER
    assert "proxy-authorization" not in leg.flow.request.headers
    assert leg.wire_headers() == [(b"authorization", b"Bearer sk-proj-ADDONSECRET9")]


def test_a_secret_header_value_keeps_its_bytes_on_the_wire():
    leg = make(Headers(cookie="a=caf\u00e9 \u20ac"))
    assert leg.wire_headers() == [(b"cookie", "a=caf\u00e9 \u20ac".encode())]


def test_a_rejection_body_is_shown_decoded_and_masked_and_a_binary_echo_is_masked(monkeypatch):
    import gzip

    from codex_failover.mitm.secret_guard import SECRETS

    monkeypatch.setattr(SECRETS, "mask", lambda text: text.replace("sk-proj-POOLKEY1234", "sk-***"))
    leg = make(Headers())
    body = gzip.compress(b'{"error":"invalid key sk-proj-POOLKEY1234"}')
    asyncio.run(leg.rejected(401, [(b"content-encoding", b"gzip")], body, "upgrade rejected"))
    assert leg.flow.response.content == b'{"error":"invalid key sk-***"}'
    assert "content-encoding" not in leg.flow.response.headers
    other = make(Headers())

    async def binary():
        await other.accepted([])
        other.message(b'{"error":"bad key sk-proj-POOLKEY1234"}', False, False)

    asyncio.run(binary())
    assert other.flow.websocket.messages[0].content == b'{"error":"bad key sk-***"}'


def test_the_bound_holds_for_what_masking_makes_of_a_message(monkeypatch):
    from codex_failover.mitm.secret_guard import SECRETS

    monkeypatch.setattr(ws_leg, "KEEP", 1000)
    monkeypatch.setattr(SECRETS, "mask", lambda text: text * 3)  # masking that grows the text
    leg = make(Headers())

    async def run():
        await leg.accepted([])
        leg.message(b"k" * 800, True, False)

    asyncio.run(run())
    assert sum(len(m.content) for m in leg.flow.websocket.messages) < 1000
