"""net/usage_fetch.py against a real local server: a hostile usage answer costs a chunk's worth of memory."""

from __future__ import annotations

import asyncio
import ssl
import tracemalloc

from codex_failover.net.socks_bridge import SocksBridges
from codex_failover.net.usage_fetch import MAX_BODY, get_json


async def _answer(chunks: list[bytes]):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        await asyncio.sleep(5)  # and then nothing more
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_chunk_that_says_300_mib_is_not_read():
    async def run():
        block = b"x" * (1024 * 1024)
        server = await _answer([b"12C00000\r\n", *[block] * 8])  # 300 MiB announced, 8 MiB sent
        port = server.sockets[0].getsockname()[1]
        tracemalloc.start()
        try:
            try:
                _, doc = await get_json(f"http://127.0.0.1:{port}/backend-api/wham/usage", {}, None,
                                             SocksBridges(), ssl.create_default_context(), 5)
            except ValueError:
                doc = None  # refused outright: as good
            peak = tracemalloc.get_traced_memory()[1]
            assert doc is None
        finally:
            tracemalloc.stop()
            server.close()
        assert peak < 2 * MAX_BODY + 512 * 1024, peak

    asyncio.run(run())


def test_a_whole_answer_in_chunks_is_read():
    async def run():
        server = await _answer([b"5\r\n{\"a\":\r\n", b"2\r\n1}\r\n", b"0\r\n\r\n"])
        port = server.sockets[0].getsockname()[1]
        try:
            status, doc = await get_json(f"http://127.0.0.1:{port}/backend-api/wham/usage", {}, None, SocksBridges(),
                                         ssl.create_default_context(), 5)
        finally:
            server.close()
        assert (status, doc) == (200, {"a": 1})

    asyncio.run(run())
