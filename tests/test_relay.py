"""The loopback relay: one-time tokens, live streaming, abort when the reader leaves."""

import asyncio


from codex_failover.net.relay import Relay, RelaySession, UpstreamBroken


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def fetch(port, path, body=b""):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def session(chunks, aborted, fail=None):
    async def body():
        for c in chunks:
            yield c
            await asyncio.sleep(0)
        if fail:
            raise UpstreamBroken(fail)

    return RelaySession(200, "OK", [(b"content-type", b"text/event-stream"), (b"content-length", b"999")], body,
                        lambda: aborted.append(True))


def test_serves_once_then_403():
    async def main():
        relay = Relay()
        await relay.start()
        aborted = []
        token = relay.register(session([b"held ", b"live"], aborted))
        first = await fetch(relay.port, f"/r/{token}", b"request body is read and ignored")
        second = await fetch(relay.port, f"/r/{token}")
        unknown = await fetch(relay.port, "/r/nope")
        await relay.close()
        return first, second, unknown, aborted

    first, second, unknown, aborted = run(main())
    head, _, body = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"transfer-encoding: chunked" in head
    assert b"content-length" not in head.lower()  # hop-by-hop headers are replaced
    assert body == b"5\r\nheld \r\n4\r\nlive\r\n0\r\n\r\n"
    assert second.startswith(b"HTTP/1.1 403")
    assert unknown.startswith(b"HTTP/1.1 403")
    assert aborted  # abort is idempotent and always called when a session ends


def test_upstream_failure_truncates_the_stream():
    async def main():
        relay = Relay()
        await relay.start()
        token = relay.register(session([b"part"], [], fail="reset"))
        data = await fetch(relay.port, f"/r/{token}")
        await relay.close()
        return data

    data = run(main())
    assert data.endswith(b"4\r\npart\r\n")  # no final 0-chunk: the client sees a cut stream


def test_reader_leaving_aborts_the_upstream():
    async def main():
        relay = Relay()
        await relay.start()
        aborted = asyncio.Event()
        forever = asyncio.Event()

        async def body():
            yield b"first"
            await forever.wait()

        token = relay.register(RelaySession(200, "OK", [], body, aborted.set))
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(f"GET /r/{token} HTTP/1.1\r\n\r\n".encode())
        await reader.readuntil(b"first\r\n")
        writer.close()
        await asyncio.wait_for(aborted.wait(), 2)
        await relay.close()

    run(main())
