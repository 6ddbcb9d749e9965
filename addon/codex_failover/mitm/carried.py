"""What a kept connection (warm_conn.py) asks of what it carries: an attempt (attempt.py's Attempt),
or a gated WebSocket's upstream socket (ws/layer_socket.py's LayerSocket), which is an attempt told
each hook, read and frame besides. The connection only knows these, so it sits below the attempts."""

from __future__ import annotations

import asyncio
from typing import Protocol

from mitmproxy import http


class Carried(Protocol):
    flow: http.HTTPFlow  # the attempt's own flow, run by the connection's layers
    stream_id: int  # its stream on the connection (given by `submit`)
    sent: bool  # its request head was written
    abandoned: bool  # cancelled while it waited for its connection: it never gets it
    over: asyncio.Event  # its final hook ran

    def arm(self) -> None:
        """The real header values on the flow, for one synchronous step of the layers."""

    def mark_sent(self) -> None:
        """The request head was written."""

    def redact(self) -> None:
        """Placeholders on the flow again."""


class CarriedSocket(Carried, Protocol):
    def hooked(self, name: str, before: bool) -> None:
        """Each hook of its flow, before and after every addon ran it."""

    def received(self, n: int) -> None:
        """`n` bytes read from the upstream."""

    def from_layers(self, data: bytes) -> None:
        """Frames mitmproxy's layers send the socket's client side."""
