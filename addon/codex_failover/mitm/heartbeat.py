"""Heartbeat mode of recovery: the client's headers go out early, and keepalive events flow while
the response is buffered and retried, so a long turn never trips the client's idle timeout.

Codex dispatches SSE on each `data:` payload's JSON `type` and ignores types it does not know, but
any data event resets its idle timer (an SSE comment does not). So a heartbeat is
`{"type":"keepalive"}`: ignored, and enough to keep the stream alive. The winning response's body
follows in full; if recovery is exhausted, the failure arrives in-stream as `response.failed`
(there is no status left to set), then the stream closes.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

HEARTBEAT = b'event: keepalive\ndata: {"type":"keepalive"}\n\n'
STREAM_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                  (b"x-codex-failover-heartbeat", b"1")]


class HeartbeatSink:
    def __init__(self, interval: float):
        self.interval = interval
        self._queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, body: Callable[[], AsyncIterator[bytes]]) -> None:
        """The winner: its body (held bytes, then any live rest) ends the stream."""
        self._queue.put_nowait(body)

    def fail(self, status: int, error: dict) -> None:
        """No winner: the failure in-stream, then the end."""
        event = {"type": "response.failed", "response": {"id": "resp_codex_failover", "status": "failed",
                                                          "error": {**error, "status": status}}}
        payload = b"event: response.failed\ndata: " + json.dumps(event).encode() + b"\n\n"

        async def body():
            yield payload

        self._queue.put_nowait(body)

    async def body(self) -> AsyncIterator[bytes]:
        """What the relay streams: heartbeats until the outcome arrives, then the outcome."""
        while True:
            try:
                outcome = await asyncio.wait_for(self._queue.get(), self.interval)
            except TimeoutError:
                yield HEARTBEAT
                continue
            async for chunk in outcome():
                yield chunk
            return
