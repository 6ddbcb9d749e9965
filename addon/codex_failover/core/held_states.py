"""The lifecycle of one held client stream (mitm/held_stream.py), in h11's manner: named states, the
events that move it, and one transition table. Pure: the shell asks `after(state, event)` and carries
out what the new state means.

    CHOOSING ──direct──▶ DIRECT_HELD ──release──▶ DIRECT_RELEASED ──end──▶ ENDED
       │                     │  └──answer──▶ ANSWERING (the stand-in answers, attempt 1 goes on for the run)
       │                     └──cancel──▶ STAND_IN
       └──stand_in──▶ STAND_IN ──answer──▶ ANSWERING ──end──▶ ENDED
                          └──upgrade──▶ UPGRADED ──end──▶ ENDED
    any state ──client_left──▶ ENDED (the client reset or closed its stream); ENDED takes every event

- CHOOSING: the request hook returned; the run has not chosen where attempt 1 goes. The stream's
  connection request waits (it is answered at the choice).
- DIRECT_HELD: attempt 1 rides the stream: its request goes upstream on the stream's own connection,
  and what comes back is held for the run.
- DIRECT_RELEASED: attempt 1 committed: what was held, then the rest, pass to the client (whole SSE
  events, core/after_output.py).
- STAND_IN: the stream's connection is its stand-in (never dialled); the run's answer is still to come.
- ANSWERING: the stand-in hands the stream an answer (a whole response, a winner's stream, a heartbeat).
- UPGRADED: the stand-in answered 101; WebSocket bytes go both ways.
- ENDED: the answer ended, or the client left.
"""

from __future__ import annotations

import enum


class HeldState(enum.Enum):
    CHOOSING = "choosing"
    DIRECT_HELD = "direct, held"
    DIRECT_RELEASED = "direct, released"
    STAND_IN = "stand-in"
    ANSWERING = "answering"
    UPGRADED = "upgraded"
    ENDED = "ended"


class HeldEvent(enum.Enum):
    DIRECT = "the run chose attempt 1 on the stream"
    STAND_IN = "the run chose the stand-in"
    RELEASE = "attempt 1 committed"
    CANCEL = "attempt 1 stopped: the stream goes to its stand-in"
    ANSWER = "the stand-in answers"
    UPGRADE = "the stand-in answers 101"
    END = "the answer ended"
    CLIENT_LEFT = "the client left"


class HeldStateError(RuntimeError):
    """An event the stream's state does not take: a bug in the shell, never the client's doing."""


S, E = HeldState, HeldEvent

TRANSITIONS: dict[tuple[HeldState, HeldEvent], HeldState] = {
    (S.CHOOSING, E.DIRECT): S.DIRECT_HELD,
    (S.CHOOSING, E.STAND_IN): S.STAND_IN,
    (S.DIRECT_HELD, E.RELEASE): S.DIRECT_RELEASED,
    (S.DIRECT_HELD, E.CANCEL): S.STAND_IN,
    (S.DIRECT_HELD, E.ANSWER): S.ANSWERING,  # recovery's heartbeat: the stand-in answers, attempt 1 feeds the run
    (S.STAND_IN, E.ANSWER): S.ANSWERING,
    (S.STAND_IN, E.UPGRADE): S.UPGRADED,
    (S.ANSWERING, E.CANCEL): S.ANSWERING,  # attempt 1 stopped while the stand-in answers: nothing changes here
    (S.STAND_IN, E.CANCEL): S.STAND_IN,
}
# Ends: an answer ends, or a client leaves, in any state. Once ENDED, nothing moves it: what the run
# or the layers still do (a commit, a cancel, a 101 racing the client's reset) finds the stream ended.
for _state in HeldState:
    TRANSITIONS[(_state, E.END)] = S.ENDED
    TRANSITIONS[(_state, E.CLIENT_LEFT)] = S.ENDED
for _event in HeldEvent:
    TRANSITIONS[(S.ENDED, _event)] = S.ENDED



def after(state: HeldState, event: HeldEvent) -> HeldState:
    """The state `event` moves `state` to; HeldStateError if the table has no such move."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise HeldStateError(f"a held stream {state.value} cannot take: {event.value}") from None
