"""A committed stream's way to the held client: what the hold kept, then the live rest, each chunk
through its attempt's machine (core/attempt_machine.py `live`): the client gets whole events, the
artifacts the credential made are learnt, and a rejection after the output began ends the stream
there instead (core/after_output.py), without `response.completed`, so Codex re-sends the request."""

from __future__ import annotations

import time
from typing import Callable

from ..core.after_output import Released
from ..core.attempt_events import Commit
from ..core.attempt_machine import AttemptMachine
from ..net.relay import UpstreamBroken
from .attempt import CHUNK, END, Attempt
from .held_client import HeldClient


def commit(client: HeldClient, attempt: Attempt, state: AttemptMachine, command: Commit, metrics,
           cut: Callable[[], None]) -> None:
    """`cut`: told once, should the stream end at a rejection after its output began."""
    feed = watched(state, cut)
    if getattr(attempt, "direct", False):  # attempt 1 rode the client's stream (direct.py)
        if client.sink is None:
            return client.release(attempt, feed, command.held)
        attempt.commit_through_hop()  # the hop answers already (recovery's heartbeat): the items go on
    resp = attempt.flow.response
    committed = time.monotonic()
    sized = "content-length" in resp.headers

    async def body():
        if metrics is not None:  # the head and the held bytes (the first output) went out
            metrics.first_output_to_client_seconds(time.monotonic() - committed)
        if command.error is not None:
            raise UpstreamBroken(command.error)
        if command.ended:
            return
        while True:
            item = await attempt.next_batch()
            if item.kind not in (CHUNK, END):
                raise UpstreamBroken(item.data.decode(errors="replace"))
            released = feed(item.data if item.kind == CHUNK else None)
            if released.out:
                yield released.out
            if released.cut is not None:
                await attempt.cancel()
                if sized:  # a body of a stated length is cut off (its client would wait for the rest)
                    raise UpstreamBroken("the stream ends before a rejection after its output began")
                return
            if item.kind == END:
                return

    client.stream(resp.status_code, resp.reason, list(resp.headers.fields), body, command.held)


def watched(state: AttemptMachine, cut: Callable[[], None]) -> Callable[[bytes | None], Released]:
    """Each chunk of the committed stream (None: its end) through its machine; `cut` told at a cut."""

    def feed(data: bytes | None) -> Released:
        released = state.live(data)
        if released.cut is not None:
            cut()
        return released

    return feed
