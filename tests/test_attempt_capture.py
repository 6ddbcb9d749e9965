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


def test_a_finished_attempts_flow_keeps_no_way_back_to_it():
    """Its flow lives on (mitmweb, `-w`) but keeps no way back to the attempt: the response's stream
    callable (the attempt's) is let go at the final hook, so the attempt and what it holds are freed
    by reference counting, not at the collector's next pass (pool-only mode: every attempt is one)."""
    import asyncio
    import gc

    from mitmproxy.test import tflow

    from codex_failover.mitm.attempt import Attempt

    def reaches(root, target) -> bool:
        seen, todo = {id(root)}, [root]
        while todo and len(seen) < 50_000:
            for ref in gc.get_referents(todo.pop()):
                if ref is target:
                    return True
                if id(ref) not in seen and not isinstance(ref, type):
                    seen.add(id(ref))
                    todo.append(ref)
        return False

    attempt = Attempt(tflow.tflow(), tflow.tflow().request, "r1#1", 1, None)  # type: ignore[arg-type]
    attempt.flow.response = http.Response.make(200, b"")
    attempt.on_responseheaders(True)
    assert attempt.flow.response.stream(b"data: x\n\n") == b"data: x\n\n"
    assert reaches(attempt.flow, attempt)  # while it streams, the flow calls it
    attempt.judged.set()
    asyncio.run(attempt.on_response())
    assert attempt.flow.response.stream is True  # streamed, as shown
    assert not reaches(attempt.flow, attempt), "the attempt's flow keeps it alive in a cycle"
