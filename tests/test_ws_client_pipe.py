"""ws/client_pipe.py: the gated socket's client side in process (the 101's headers, the bounded reader)."""

from __future__ import annotations

import asyncio

from mitmproxy import http
from wsproto.utilities import generate_accept_token

from codex_failover.ws.client_pipe import PipeReader, upgrade_headers

KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def request_headers(*extra):
    return http.Headers([(b"sec-websocket-key", KEY.encode()), (b"sec-websocket-version", b"13"), *extra])


def test_the_101_has_the_accept_token_and_the_upstreams_own_headers_but_not_its_handshake():
    upstream = [(b"x-codex-turn-state", b"ts-1"), (b"sec-websocket-accept", b"upstream's"), (b"connection", b"upgrade")]
    headers = upgrade_headers(request_headers(), upstream)
    assert headers == [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
                       (b"sec-websocket-accept", generate_accept_token(KEY.encode())), (b"x-codex-turn-state", b"ts-1")]


def test_deflate_is_accepted_only_when_offered():
    offered = upgrade_headers(request_headers((b"sec-websocket-extensions", b"permessage-deflate; client_max_window_bits")), [])
    assert (b"sec-websocket-extensions", b"permessage-deflate; client_max_window_bits=15") in offered
    unknown = upgrade_headers(request_headers((b"sec-websocket-extensions", b"x-webkit-deflate-frame")), [])
    assert not [k for k, _ in unknown if k == b"sec-websocket-extensions"]


def test_the_reader_hands_out_in_order_splits_large_chunks_and_ends_at_eof():
    async def run():
        reader = PipeReader(1000, lambda: None)
        reader.feed(b"abcdef")
        reader.feed(b"gh")
        assert await reader.read(4) == b"abcd"
        assert await reader.read(100) == b"ef"
        assert await reader.read(100) == b"gh"
        waiting = asyncio.ensure_future(reader.read(100))
        await asyncio.sleep(0)
        assert not waiting.done()
        reader.feed(b"")
        assert await asyncio.wait_for(waiting, 1) == b""
        reader.feed(b"late")  # after the end: dropped
        assert await reader.read(10) == b""

    asyncio.run(asyncio.wait_for(run(), 5))


def test_the_reader_is_bounded_and_says_so_once():
    async def run():
        overs = []
        reader = PipeReader(10, lambda: overs.append(1))
        reader.feed(b"y" * 64)  # one piece of any size is taken (the gate's own bound answers it with 1009)
        assert await reader.read(100) == b"y" * 64
        reader.feed(b"x" * 8)
        reader.feed(b"x" * 8)  # 8 were waiting: still taken
        reader.feed(b"x" * 8)  # 16 were waiting: over, not taken, the end
        reader.feed(b"x" * 8)
        assert overs == [1]
        assert await reader.read(100) == b"x" * 8
        assert await reader.read(100) == b"x" * 8
        assert await reader.read(100) == b""

    asyncio.run(asyncio.wait_for(run(), 5))
