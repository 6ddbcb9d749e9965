"""The loopback relay against hostile connections (issue 14 item 6), in process: a real `Relay` on
127.0.0.1 and raw client sockets. Bad or idle connections are answered or closed quietly, one
debug line each and never a traceback; a bad token is refused before its body is read."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import time

import pytest

from codex_failover.net.relay import Relay, RelaySession


def run(coro):
    async def main():
        try:
            return await asyncio.wait_for(coro, 10)
        finally:
            gc.collect()  # log any task exception never retrieved while the loop still runs
    return asyncio.run(main())


@pytest.fixture
def quiet(caplog):
    """Fails the test if anything was logged at WARNING or above, or with a traceback (asyncio's
    "Unhandled exception in client_connected_cb" and "Task exception was never retrieved" are
    ERRORs); yields a function giving the relay's debug lines so far."""
    caplog.set_level(logging.DEBUG, logger="codex_failover")
    yield lambda: [r.getMessage() for r in caplog.records if r.name == "codex_failover"]
    gc.collect()  # an unretrieved task exception is only logged when its task is collected
    records = caplog.get_records("call") + caplog.records  # the test's, and this teardown's
    loud = [r for r in records if r.levelno >= logging.WARNING or r.exc_info or r.exc_text]
    assert not loud, "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}" for r in loud)


async def started(**deadlines) -> Relay:
    relay = Relay(**deadlines)
    await relay.start()
    return relay


async def until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """All the relay sends until it closes (reset counts as closed)."""
    data = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk


async def send_head(port: int, head: bytes):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), as a crashed client would."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


def test_unknown_token_is_refused_before_the_body(quiet):
    async def main():
        relay = await started(linger=0.3)
        reader, writer = await send_head(relay.port, b"POST /r/no-such-token HTTP/1.1\r\nhost: x\r\n"
                                                     b"content-length: 1000000000000\r\n\r\n")
        start = time.monotonic()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1)
        answered = time.monotonic() - start
        await until_closed(reader, 2)  # the relay hangs up after its short linger
        closed = time.monotonic() - start
        writer.close()
        await relay.close()
        return answer, answered, closed

    answer, answered, closed = run(main())
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert b"connection: close" in answer
    assert answered < 1
    assert closed < 1.5


def test_a_trickled_body_does_not_keep_a_refused_connection(quiet):
    async def main():
        relay = await started(linger=0.3)
        reader, writer = await send_head(relay.port, b"POST /r/nope HTTP/1.1\r\ncontent-length: 1000000000000\r\n\r\n")
        start = time.monotonic()
        trickle = asyncio.create_task(_trickle(writer))
        await until_closed(reader, 2)
        closed = time.monotonic() - start
        trickle.cancel()
        writer.close()
        await relay.close()
        return closed

    assert run(main()) < 1.5


async def _trickle(writer):
    try:
        while True:
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)
    except ConnectionError:
        pass


@pytest.mark.parametrize("head, status", [
    (b"POST /r/tok HTTP/1.1\r\ncontent-length: abc\r\n\r\n", b"400"),
    (b"POST /r/tok HTTP/1.1\r\ncontent-length: 9" + b"9" * 5000 + b"\r\n\r\n", b"400"),  # int() would raise
    (b"POST /r/tok HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", b"400"),
    (b"POST /r/tok HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n", b"400"),
    (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", b"400"),  # a TLS hello, say
    (b"GET /r/tok\r\n\r\n", b"400"),
    (b"GET /r/tok HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
    (b"GET /r/tok HTTP/1.1\r\n folded: header\r\n\r\n", b"400"),
    (b"GET /r/tok HTTP/1.1\r\nx: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
    (b"GET /elsewhere HTTP/1.1\r\n\r\n", b"403"),
])
def test_malformed_requests_get_an_answer_and_a_close(quiet, head, status):
    async def main():
        relay = await started(linger=0.3)
        reader, writer = await send_head(relay.port, head)
        data = await until_closed(reader, 2)
        writer.close()
        await relay.close()
        return data

    assert run(main()).startswith(b"HTTP/1.1 " + status + b" ")
    assert len(quiet()) == 1
    assert quiet()[0].startswith("relay: ")  # one debug line


def test_a_malformed_request_does_not_claim_a_good_token(quiet):
    """The head is validated before the token is looked up: a garbled request for a real token
    leaves the session for mitmproxy's real fetch."""
    async def main():
        relay = await started(linger=0.3)
        token = relay.register(RelaySession(200, "OK", [], _body(b"hello"), lambda: None))
        reader, writer = await send_head(relay.port, f"POST /r/{token} HTTP/1.1\r\ncontent-length: x\r\n\r\n".encode())
        refused = await until_closed(reader, 2)
        writer.close()
        reader, writer = await send_head(relay.port, f"GET /r/{token} HTTP/1.1\r\n\r\n".encode())
        served = await until_closed(reader, 2)
        writer.close()
        await relay.close()
        return refused, served

    refused, served = run(main())
    assert refused.startswith(b"HTTP/1.1 400")
    assert served.startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_closed_at_the_head_deadline(quiet):
    async def main():
        relay = await started(head_timeout=0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        start = time.monotonic()
        data = await until_closed(reader, 2)
        closed = time.monotonic() - start
        writer.close()
        await relay.close()
        return data, closed

    data, closed = run(main())
    assert data == b""
    assert 0.25 < closed < 1
    assert quiet() == ["relay: no request head within 0.3s; closing"]


def test_300_idle_connections_end_quietly(quiet):
    async def main():
        relay = await started(head_timeout=0.5)
        conns = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(300)]
        await asyncio.sleep(0.05)
        for _, writer in conns[:150]:  # the client leaves: some cleanly, some with a reset
            reset(writer) if id(writer) % 2 else writer.close()
        # the rest stay idle until the relay closes them at its deadline
        await asyncio.gather(*(until_closed(reader, 2) for reader, _ in conns[150:]))
        for _, writer in conns[150:]:
            writer.close()
        await asyncio.sleep(0.05)
        await relay.close()

    run(main())
    assert len(quiet()) == 300  # one debug line each


def test_a_reader_leaving_mid_stream_aborts_quietly(quiet):
    async def main(leave):
        relay = await started()
        aborted = asyncio.Event()
        forever = asyncio.Event()

        async def body():
            yield b"first"
            await forever.wait()

        token = relay.register(RelaySession(200, "OK", [], body, aborted.set))
        reader, writer = await send_head(relay.port, f"POST /r/{token} HTTP/1.1\r\ncontent-length: 4\r\n\r\nbody".encode())
        await reader.readuntil(b"first\r\n")
        leave(writer)
        await asyncio.wait_for(aborted.wait(), 2)
        await asyncio.sleep(0.05)
        assert relay.streaming == 0
        await relay.close()

    run(main(lambda writer: writer.close()))
    run(main(reset))


def test_a_reader_resetting_while_the_stream_is_written_aborts_quietly(quiet):
    """The reset reaches both the write (pump) and the watch for the reader leaving: neither
    task's exception may be left unretrieved."""
    async def main():
        relay = await started()
        aborted = asyncio.Event()

        async def body():
            while True:
                yield b"x" * 65536
                await asyncio.sleep(0)

        token = relay.register(RelaySession(200, "OK", [], body, aborted.set))
        reader, writer = await send_head(relay.port, f"GET /r/{token} HTTP/1.1\r\n\r\n".encode())
        await reader.readexactly(100_000)
        reset(writer)
        await asyncio.wait_for(aborted.wait(), 2)
        await asyncio.sleep(0.05)
        await relay.close()

    run(main())


def test_a_body_slower_than_its_deadline_aborts_the_session(quiet):
    async def main():
        relay = await started(body_timeout=0.3)
        aborted = asyncio.Event()
        token = relay.register(RelaySession(200, "OK", [], _body(b"never"), aborted.set))
        reader, writer = await send_head(relay.port, f"POST /r/{token} HTTP/1.1\r\ncontent-length: 100\r\n\r\nhalf".encode())
        start = time.monotonic()
        data = await until_closed(reader, 2)
        closed = time.monotonic() - start
        await asyncio.wait_for(aborted.wait(), 1)
        writer.close()
        await relay.close()
        return data, closed

    data, closed = run(main())
    assert data == b""
    assert closed < 1  # the session was claimed: nothing to answer, the stream is off


def test_a_chunked_request_body_is_read_before_streaming(quiet):
    """mitmproxy forwards a chunked client body chunked: its first byte is not the reader leaving."""
    async def main():
        relay = await started()

        async def body():
            yield b"held "
            await asyncio.sleep(0.2)  # time for a stray body byte to be taken for the reader leaving
            yield b"live"

        token = relay.register(RelaySession(200, "OK", [], body, lambda: None))
        reader, writer = await send_head(relay.port, f"POST /r/{token} HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
                                                     "5;ext=1\r\nhello\r\n3\r\n!!!\r\n0\r\nx-trailer: 1\r\n\r\n".encode())
        data = await until_closed(reader, 2)
        writer.close()
        await relay.close()
        return data

    data = run(main())
    assert data.endswith(b"\r\n\r\n5\r\nheld \r\n4\r\nlive\r\n0\r\n\r\n"), data


def test_a_bug_is_logged_once_as_an_error(caplog):
    """Only a bug is loud: one ERROR with its traceback, still no unhandled task exception."""
    async def main():
        relay = await started()
        aborted = []

        async def body():
            yield b"first"
            raise RuntimeError("a bug")

        token = relay.register(RelaySession(200, "OK", [], body, lambda: aborted.append(1)))
        reader, writer = await send_head(relay.port, f"GET /r/{token} HTTP/1.1\r\n\r\n".encode())
        await until_closed(reader, 2)
        writer.close()
        await relay.close()
        return aborted

    assert run(main()) == [1]
    gc.collect()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(r.name, r.getMessage()) for r in errors] == [("codex_failover", "codex-failover internal error in the relay")]
    assert errors[0].exc_info[0] is RuntimeError


def _body(*chunks):
    async def body():
        for chunk in chunks:
            yield chunk
    return body
