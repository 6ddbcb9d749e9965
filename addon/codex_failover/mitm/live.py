"""A committed stream's way to the held client: what the hold kept, then the live rest, each chunk
shown to its attempt's machine (the artifacts its credential made, core/attempt_machine.py)."""

from __future__ import annotations

import time

from ..core.attempt_events import Commit
from ..core.attempt_machine import AttemptMachine
from ..net.relay import UpstreamBroken
from .attempt import CHUNK, END, Attempt
from .held_client import HeldClient


def commit(client: HeldClient, attempt: Attempt, state: AttemptMachine, command: Commit, metrics) -> None:
    if getattr(attempt, "direct", False):  # attempt 1 rode the client's stream (direct.py)
        if client.sink is None:
            return client.release(attempt, state)
        attempt.commit_through_hop()  # the hop answers already (recovery's heartbeat): the items go on
    resp = attempt.flow.response
    committed = time.monotonic()

    async def body():
        if metrics is not None:  # the head and the held bytes (the first output) went out
            metrics.first_output_to_client_seconds(time.monotonic() - committed)
        if command.error is not None:
            raise UpstreamBroken(command.error)
        if command.ended:
            return
        while True:
            item = await attempt.next_batch()
            if item.kind == CHUNK:
                state.live(item.data)
                yield item.data
            elif item.kind == END:
                state.live(None)
                return
            else:
                raise UpstreamBroken(item.data.decode(errors="replace"))

    client.stream(resp.status_code, resp.reason, list(resp.headers.fields), body, command.held)
