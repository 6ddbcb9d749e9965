"""permessage-deflate that stops inflating a message past the largest message the gate takes.

wsproto inflates each piece of a compressed frame in one call, whatever it inflates to: 64 KiB
read from a hostile upstream can hold 64 MiB, and a frame of a few MiB some GiB, all inflated
before WsConn could count the message's size. Here each piece is inflated with zlib's `max_length`
at what is left of the message's allowance, and a message that would pass it ends the connection
with 1009 (message too big), as the uncompressed case already does (ws/conn.py). One read's work is
then bounded by `max_message` of output (failover_max_body).
"""

from __future__ import annotations

import zlib

from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason


class BoundedDeflate(PerMessageDeflate):
    def __init__(self, max_message: int, **kwargs):
        super().__init__(**kwargs)
        self.max_message = max_message
        self._taken = 0  # inflated bytes of the message being received

    def frame_inbound_payload_data(self, proto, data: bytes) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        assert self._decompressor is not None
        try:  # one byte more than is left: enough to know the message is over the limit
            out = self._decompressor.decompress(bytes(data), self.max_message - self._taken + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._taken += len(out)
        if self._taken > self.max_message:
            return CloseReason.MESSAGE_TOO_BIG
        return out

    def frame_inbound_complete(self, proto, fin: bool) -> bytes | CloseReason | None:
        result = super().frame_inbound_complete(proto, fin)
        if fin:
            self._taken = 0
        return result
