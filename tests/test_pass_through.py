"""core/pass_through.py: which passed-through bodies stream, which are read whole."""

import pytest

from codex_failover.core.pass_through import STREAM_ABOVE, streams


@pytest.mark.parametrize(("length", "ctype", "streamed"), [
    ("120", None, False),  # a small request (telemetry): read whole, map_remote still applies
    (str(STREAM_ABOVE), "application/json", False),
    (str(STREAM_ABOVE + 1), None, True),  # large: streamed, the proxy holds a chunk
    (str(300 << 20), "application/octet-stream", True),
    (None, None, True),  # chunked, or HTTP/2 without a length: could be any size
    ("", "application/json", True),
    ("12x", None, True),
    ("40", "text/event-stream; charset=utf-8", True),  # an event stream reaches its client as it comes
    (None, "Text/Event-Stream", True),
])
def test_which_bodies_stream(length, ctype, streamed):
    assert streams(length, ctype) is streamed
