"""An HTTP/2-only fake of the Responses API over TLS, for what one upstream connection can do to the
streams on it: `python h2_fake.py [--port 0] [--log FILE] [--pace 0.05] [--deltas 6]`.

Every POST .../responses is answered with an SSE stream (tests/support/fake_upstream.Turn), labelled
with the request's API key. What the connection does is chosen by that key:

  sk-...-goaway-graceful  after its first event, a GOAWAY (NO_ERROR, last stream id = the highest
                          stream opened): every stream already opened is still served to its end,
                          no new stream is accepted; the connection closes once they are done
  sk-...-goaway-unprocessed  at the request, a GOAWAY (NO_ERROR) whose last stream id is below it:
                          the stream was never processed (and is never answered)
  sk-...-goaway-hard      after its first event, a GOAWAY (INTERNAL_ERROR) and the socket closed
  sk-...-reset            after its first event, the TCP connection reset (RST)
  sk-...-bighead          answered with a 16 MiB header block
  sk-...-overload         an in-stream overload error after response.created
  anything else           a healthy answer

The log (one JSON object per line) says which key came on which connection and stream, and what each
connection did, so a test can see that no two credentials share a connection.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import ssl
import sys
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_upstream import Turn, self_signed_context  # noqa: E402

BIG_HEADER = 16 * 1024 * 1024


class H2Fake:
    def __init__(self, pace: float, deltas: int, log):
        self.pace, self.deltas, self.log = pace, deltas, log
        self.ids = itertools.count(1)

    def note(self, **what) -> None:
        if self.log is not None:
            self.log.write(json.dumps(what) + "\n")
            self.log.flush()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_no = next(self.ids)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        state = {"goaway": False, "open": set(), "done": asyncio.Event()}
        heads: dict[int, dict[str, str]] = {}
        tasks: set[asyncio.Task] = set()
        self.note(conn=conn_no, event="open")
        try:
            while not state["done"].is_set():
                reading = asyncio.ensure_future(reader.read(65536))
                finished = asyncio.ensure_future(state["done"].wait())
                await asyncio.wait({reading, finished}, return_when=asyncio.FIRST_COMPLETED)
                finished.cancel()
                if not reading.done():
                    reading.cancel()
                    break
                data = reading.result()
                if not data:
                    break
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    self.note(conn=conn_no, event="protocol_error", error=str(exc))
                    break
                for event in events:
                    if isinstance(event, h2.events.RequestReceived):
                        heads[event.stream_id] = dict(event.headers)
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id in heads:
                        task = asyncio.ensure_future(self.answer(conn, writer, conn_no, event.stream_id,
                                                                 heads.pop(event.stream_id), state))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    elif isinstance(event, h2.events.StreamReset):
                        state["open"].discard(event.stream_id)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        state["done"].set()
                writer.write(conn.data_to_send())
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            self.note(conn=conn_no, event="closed")
            writer.close()

    async def answer(self, conn, writer, conn_no: int, sid: int, head: dict[str, str], state: dict) -> None:
        key = head.get("authorization", "").removeprefix("Bearer ")
        self.note(conn=conn_no, stream=sid, key=key, event="request", path=head.get(":path"))
        if state["goaway"]:  # (a client never sends after our GOAWAY; if it does, refused)
            conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            writer.write(conn.data_to_send())
            return
        if key.endswith("-goaway-unprocessed"):  # refused before any processing: never answered
            writer.write(GoAwayFrame(0, error_code=0, last_stream_id=sid - 2 if sid > 2 else 0).serialize())
            self.note(conn=conn_no, stream=sid, key=key, event="goaway", error_code=0, last_stream_id=max(0, sid - 2))
            state["done"].set()
            return
        if key.endswith("-bighead"):
            writer.write(big_head(sid))  # then nothing: the client refuses such a block
            self.note(conn=conn_no, stream=sid, key=key, event="bighead")
            return
        state["open"].add(sid)
        headers = [(":status", "200"), ("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        conn.send_headers(sid, headers)
        writer.write(conn.data_to_send())
        turn = Turn(key, self.deltas)
        events = turn.handshake() + ([turn.overload_error(), turn.failed("server_is_overloaded", "busy")]
                                     if key.endswith("-overload") else turn.answer())
        try:
            for i, data in enumerate(events):
                await asyncio.sleep(self.pace)
                while conn.local_flow_control_window(sid) < len(data):
                    await asyncio.sleep(0.01)
                conn.send_data(sid, data)
                writer.write(conn.data_to_send())
                if i == 0 and self.misbehave(conn, writer, conn_no, key, state):
                    return
            conn.end_stream(sid)
            writer.write(conn.data_to_send())
            self.note(conn=conn_no, stream=sid, key=key, event="done")
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, ConnectionError) as exc:
            self.note(conn=conn_no, stream=sid, key=key, event="cut", error=type(exc).__name__)
        finally:
            state["open"].discard(sid)
            if state["goaway"] and not state["open"]:
                state["done"].set()  # a graceful GOAWAY: every stream it kept is served

    def misbehave(self, conn, writer, conn_no: int, key: str, state: dict) -> bool:
        """After a stream's first event: what its key asks the connection to do. True: stop."""
        if key.endswith("-goaway-graceful") and not state["goaway"]:
            # Written by hand: h2 itself would refuse to send anything after its own GOAWAY.
            state["goaway"] = True
            last = conn.highest_inbound_stream_id
            writer.write(GoAwayFrame(0, error_code=0, last_stream_id=last).serialize())
            self.note(conn=conn_no, event="goaway", error_code=0, last_stream_id=last)
        elif key.endswith("-goaway-hard"):
            conn.close_connection(h2.errors.ErrorCodes.INTERNAL_ERROR)
            writer.write(conn.data_to_send())
            self.note(conn=conn_no, event="goaway", error_code=int(h2.errors.ErrorCodes.INTERNAL_ERROR))
            writer.transport.close()
            state["done"].set()
            return True
        elif key.endswith("-reset"):
            self.note(conn=conn_no, event="reset")
            writer.transport.abort()
            state["done"].set()
            return True
        return False


def big_head(sid: int) -> bytes:
    """A 200's header block with a 16 MiB header, as HEADERS and CONTINUATION frames written by hand
    (h2 would Huffman-code it in Python for many seconds, stalling this fake's other streams)."""
    block = hpack.Encoder().encode([(":status", "200"), ("content-type", "text/event-stream")])
    name, value = b"x-big", b"a" * BIG_HEADER
    block += b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value  # literal, not indexed
    pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)]
    frames = [HeadersFrame(sid, data=pieces[0])] + [ContinuationFrame(sid, data=p) for p in pieces[1:]]
    frames[-1].flags.add("END_HEADERS")
    return b"".join(f.serialize() for f in frames)


def _hpack_int(n: int, prefix: int = 7) -> bytes:
    """An HPACK integer with a `prefix`-bit prefix (RFC 7541 5.1), its Huffman bit clear."""
    top = (1 << prefix) - 1
    if n < top:
        return bytes([n])
    out, n = [top], n - top
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes(out + [n])


async def amain(args) -> None:
    log = open(args.log, "a") if args.log else None
    fake = H2Fake(args.pace, args.deltas, log)
    tls = self_signed_context()
    tls.set_alpn_protocols(["h2"])
    server = await asyncio.start_server(fake.serve, "127.0.0.1", args.port, ssl=tls)
    print(json.dumps({"listening": server.sockets[0].getsockname()[1], "tls": True}), flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log")
    ap.add_argument("--pace", type=float, default=0.05)
    ap.add_argument("--deltas", type=int, default=6)
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
