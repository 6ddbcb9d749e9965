"""attempt.Capture: the opening bytes of a streamed body, kept on its flow for mitmweb, and only once."""

from __future__ import annotations

from mitmproxy import http

from codex_failover.mitm.attempt import Capture


def test_a_kept_capture_holds_no_copy_of_its_own():
    """The message's stream attribute keeps the Capture as long as the flow lives: once its bytes
    are the message's content, its own buffer goes (it was a second copy of up to 64 KiB a flow)."""
    capture = Capture(limit=8)
    assert capture(b"data: one\n") == b"data: one\n"  # the stream goes on untouched
    response = http.Response.make(200, b"")
    capture.keep_on(response)
    assert response.raw_content == b"data: on"
    assert len(capture.data) == 0
    assert capture(b"more") == b"more" and len(capture.data) == 0  # nothing kept after the end
    again = http.Response.make(200, b"")
    capture.keep_on(again)  # a second message gets the same bytes, not an empty copy
    assert again.raw_content is response.raw_content


def test_a_capture_keeps_its_bound():
    capture = Capture(limit=5)
    for chunk in (b"abc", b"defgh", b"ij"):
        capture(chunk)
    response = http.Response.make(200, b"")
    capture.keep_on(response)
    assert response.raw_content == b"abcde"
    capture.keep_on(None)  # no message: nothing to do
