"""core/pass_through.py: which passed-through bodies stream, which are read whole."""

import pytest

from codex_failover.core.pass_through import ANSWERED_BODY, STREAM_ABOVE, small_enough, streams


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


@pytest.mark.parametrize(("length", "encoding", "small"), [
    (None, None, True),  # an HTTP/1 request with neither header has no body (curl -X POST)
    ("0", None, True),
    (str(ANSWERED_BODY), None, True),
    (str(ANSWERED_BODY + 1), None, False),  # closed unread, never gathered whole
    (None, "chunked", False),
    ("²", None, False),  # not ASCII digits ("²".isdigit() is true)
    ("1" * 5000, None, False),  # past int()'s digit limit: never parsed
])
def test_what_a_request_the_addon_answers_itself_may_carry(length, encoding, small):
    assert small_enough(length, encoding) is small


def test_a_length_that_is_no_ascii_number_streams():
    assert streams("²") and streams("1" * 5000)
