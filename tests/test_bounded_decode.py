"""The bounded decoder (bounded_decode.py) and the bounded permessage-deflate (ws/bounded_deflate.py):
each coding decodes as mitmproxy's get_content(strict=False) does, no step produces more than its
slice, and a body past the cap stops there, kept nowhere."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
from mitmproxy.net import encoding as mitm_encoding

from codex_failover.bounded_decode import BoundedDecoder, Outcome, decode, zstd

TEXT = b'{"error": {"message": "Our servers are currently overloaded.", "code": "server_is_overloaded"}}' * 50


def gzip_members(*parts: bytes) -> bytes:
    return b"".join(gzip.compress(p) for p in parts)


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


def zeros(encoding: str, mib: int) -> bytes:
    """`mib` MiB of zeros, compressed a MiB at a time."""
    chunk = bytes(1 << 20)
    if encoding == "gzip":
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    elif encoding == "deflate":
        packer = zlib.compressobj(9)
    elif encoding == "zstd":
        packer = zstd.ZstdCompressor()
    else:
        packer = brotli.Compressor()
        return b"".join(packer.process(chunk) for _ in range(mib)) + packer.finish()
    return b"".join(packer.compress(chunk) for _ in range(mib)) + packer.flush()


# (id, raw body, Content-Encoding, limit, expected outcome)
ROWS = [
    ("identity", TEXT, None, 1 << 20, Outcome(TEXT)),
    ("identity-named", TEXT, "identity", 1 << 20, Outcome(TEXT)),
    ("identity-over", TEXT, "", 100, Outcome(None, over=True)),
    ("gzip", gzip.compress(TEXT), "gzip", 1 << 20, Outcome(TEXT)),
    ("gzip-upper-case", gzip.compress(TEXT), " GZIP ", 1 << 20, Outcome(TEXT)),
    ("gzip-two-members", gzip_members(b"ab", b"cd"), "gzip", 100, Outcome(b"abcd")),  # mitmproxy: b"ab"
    ("gzip-given-zlib", zlib.compress(TEXT), "gzip", 1 << 20, Outcome(TEXT)),
    ("gzip-trailing-garbage", gzip.compress(b"ab") + b"junk", "gzip", 100, Outcome(b"ab")),
    ("gzip-exactly-the-limit", gzip.compress(TEXT), "gzip", len(TEXT), Outcome(TEXT)),
    ("gzip-one-byte-over", gzip.compress(TEXT), "gzip", len(TEXT) - 1, Outcome(None, over=True)),
    ("deflate-zlib", zlib.compress(TEXT), "deflate", 1 << 20, Outcome(TEXT)),
    ("deflate-raw", raw_deflate(TEXT), "deflate", 1 << 20, Outcome(TEXT)),
    ("zstd", zstd.compress(TEXT), "zstd", 1 << 20, Outcome(TEXT)),
    ("zstd-two-frames", zstd.compress(b"ab") + zstd.compress(b"cd"), "zstd", 100, Outcome(b"abcd")),
    ("zstd-over", zstd.compress(TEXT), "zstd", 1000, Outcome(None, over=True)),
    ("br", brotli.compress(TEXT), "br", 1 << 20, Outcome(TEXT)),
    ("br-over", brotli.compress(TEXT), "br", 1000, Outcome(None, over=True)),
    ("empty-gzip", b"", "gzip", 10, Outcome(b"")),
]


@pytest.mark.parametrize("name,raw,coding,limit,expected", ROWS, ids=[r[0] for r in ROWS])
def test_decodes_like_mitmproxy_within_the_cap(name, raw, coding, limit, expected):
    got = decode(raw, coding, limit, slice_size=256)
    assert got == expected
    if not got.over and coding and coding.strip() not in ("identity", "") and name != "gzip-two-members":
        assert got.content == mitm_encoding.decode(raw, coding.strip().lower())


# Not valid for the coding (or unknown): the raw body, as get_content(strict=False) gives it.
BROKEN = [
    ("gzip-not-gzip", b"plain text", "gzip"),
    ("zstd-truncated", zstd.compress(TEXT)[:-5], "zstd"),
    ("br-truncated", brotli.compress(TEXT)[:-3], "br"),
    ("br-garbage", b"\xff\xff\xff\xff", "br"),
    ("unknown-coding", b"abc", "compress"),
    ("stacked-codings", gzip.compress(b"abc"), "gzip, br"),
]


@pytest.mark.parametrize("name,raw,coding", BROKEN, ids=[r[0] for r in BROKEN])
def test_an_undecodable_body_is_taken_as_it_came(name, raw, coding):
    got = decode(raw, coding, 1 << 20)
    assert got.content == raw and not got.over and got.error


def test_an_undecodable_body_over_the_cap_is_over():
    assert decode(b"x" * 100, "compress", 10) == Outcome(None, over=True, error="unknown content-encoding 'compress'")


@pytest.mark.parametrize("coding", ["gzip", "deflate", "zstd", "br"])
def test_a_bomb_stops_at_the_cap_one_bounded_slice_at_a_time(coding):
    """64 MiB of zeros against an 8 MiB cap: no step returns more than its slice (brotli may pass
    it by one internal buffer), it stops right past the cap, and keeps nothing."""
    decoder = BoundedDecoder(zeros(coding, 64), coding, 8 << 20, slice_size=64 * 1024)
    steps, biggest, last = 0, 0, 0
    while (outcome := decoder.step()) is None:
        steps += 1
        biggest = max(biggest, decoder.size - last)
        last = decoder.size
    assert outcome == Outcome(None, over=True)
    assert biggest <= 64 * 1024 + (1 << 17)
    assert (8 << 20) < decoder.size <= (8 << 20) + 64 * 1024 + (1 << 17)  # never far past the cap
    assert decoder.parts == []
    assert steps >= 60  # 8 MiB in slices of 64 KiB (brotli's a little larger)


def test_steps_after_the_end_give_the_same_outcome():
    decoder = BoundedDecoder(gzip.compress(b"abc"), "gzip", 10)
    while decoder.step() is None:
        pass
    assert decoder.step() == decoder.step() == Outcome(b"abc")


# -- the gated WebSocket's permessage-deflate ----------------------------------------------------

def _deflate_pair(max_message: int):
    """A client and a server wsproto connection with permessage-deflate, the client's bounded."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request
    from wsproto.extensions import PerMessageDeflate

    from codex_failover.ws.bounded_deflate import BoundedDeflate

    client, server = WSConnection(ConnectionType.CLIENT), WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="x", target="/", extensions=[BoundedDeflate(max_message)])))
    request = next(e for e in server.events() if isinstance(e, Request))
    client.receive_data(server.send(AcceptConnection(extensions=[PerMessageDeflate()])))
    assert any(isinstance(e, AcceptConnection) for e in client.events())
    assert request is not None
    return client, server


@pytest.mark.parametrize("size,too_big", [(1000, False), (64 * 1024, False), (64 * 1024 + 1, True), (32 << 20, True)])
def test_a_compressed_message_past_the_limit_closes_with_1009(size, too_big):
    from wsproto.events import BytesMessage, CloseConnection

    client, server = _deflate_pair(64 * 1024)
    wire = server.send(BytesMessage(data=bytes(size)))
    assert len(wire) < 64 * 1024  # zeros: the whole message is a few KiB on the wire
    got, closed = bytearray(), None
    for i in range(0, len(wire), 4096):
        client.receive_data(wire[i:i + 4096])
        for event in client.events():
            if isinstance(event, BytesMessage):
                got += event.data
                assert len(got) <= 64 * 1024 + 1
            elif isinstance(event, CloseConnection):
                closed = event.code
    if too_big:
        assert closed == 1009
    else:
        assert closed is None and bytes(got) == bytes(size)


def test_the_allowance_is_per_message():
    from wsproto.events import BytesMessage

    client, server = _deflate_pair(10_000)
    for _ in range(5):  # 5 x 8000 bytes: each under the limit, together far over it
        client.receive_data(server.send(BytesMessage(data=bytes(8000))))
        assert [len(e.data) for e in client.events()] == [8000]


# -- the shell's async reading (mitm/bounded_body.py) ---------------------------------------------

def _request(body: bytes, coding: str | None):
    from mitmproxy import http

    req = http.Request.make("POST", "https://api.openai.com/v1/responses", b"", {"content-type": "application/json"})
    if coding:
        req.headers["content-encoding"] = coding
    req.raw_content = body
    return req


def test_a_held_request_body_that_decodes_past_the_cap_is_not_held(caplog):
    import asyncio

    from codex_failover.mitm import bounded_body

    bomb = _request(zeros("zstd", 64), "zstd")  # 2 KiB as sent, 64 MiB decoded
    assert asyncio.run(bounded_body.request_body(bomb, 1 << 20)) is None
    assert "decodes over failover_max_body" in caplog.text
    small = _request(zstd.compress(TEXT), "zstd")
    assert asyncio.run(bounded_body.request_body(small, 1 << 20)) == TEXT
    assert asyncio.run(bounded_body.request_body(_request(TEXT, None), 100)) is None  # over as sent


def test_decoding_gives_the_event_loop_back_every_few_milliseconds():
    """Another task runs between the slices of one decode: at least once every 5 ms (BUDGET) of
    decoding, plus one slice."""
    import asyncio
    import time

    from codex_failover.mitm import bounded_body

    bomb = _request(zeros("gzip", 256), "gzip")

    async def main():
        ticks, done = [], asyncio.Event()

        async def ticker():
            while not done.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        outcome = await bounded_body.content(bomb, 128 << 20)
        done.set()
        await task
        return outcome, ticks

    outcome, ticks = asyncio.run(main())
    assert outcome.over
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) > 5 and max(gaps) < 0.05, f"{len(ticks)} ticks, longest gap {max(gaps) * 1000:.0f} ms"
