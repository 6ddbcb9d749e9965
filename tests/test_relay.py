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


def test_a_held_session_answers_only_once_the_run_decides():
    """The hop is open from the start of the hold (held_client.py): nothing is written to it until
    `answer`, then the head and the body at once."""
    async def main():
        relay = Relay()
        await relay.start()
        held = RelaySession.held(lambda: None)
        token = relay.register(held)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(f"POST /r/{token} HTTP/1.1\r\ncontent-length: 0\r\n\r\n".encode())
        await writer.drain()
        try:
            early = await asyncio.wait_for(reader.read(1), 0.3)
        except TimeoutError:
            early = None
        assert early is None, f"the relay wrote {early!r} before the run decided"

        async def body():
            yield b"decided"

        held.answer(201, "Created", [(b"content-type", b"text/event-stream")], body)
        data = await reader.read()
        writer.close()
        await relay.close()
        return data

    data = run(main())
    assert data.startswith(b"HTTP/1.1 201 Created\r\n"), data[:80]
    assert b"\r\n7\r\ndecided\r\n0\r\n\r\n" in data, data


def test_a_reader_leaving_during_the_hold_aborts_the_run():
    async def main():
        relay = Relay()
        await relay.start()
        aborted = asyncio.Event()
        token = relay.register(RelaySession.held(aborted.set))
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(f"POST /r/{token} HTTP/1.1\r\ncontent-length: 0\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await asyncio.wait_for(aborted.wait(), 2)
        await relay.close()

    run(main())
