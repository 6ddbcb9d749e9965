"""The WebSocket gate's per-socket state: which turn is open, what is held, whether a rejected turn
may move. Pure (no mitmproxy, no I/O, clock injected): the shell feeds it messages and carries out
what it returns.

On Codex's Responses WebSocket every client `response.create` starts a turn, and the server
answers with the same JSON events as SSE, one per message. Each turn opens a bootstrap window:
the server messages of that turn go through the same classifier as an SSE stream (one message is
one frame, empty ones included) and are held until it decides. Messages outside a window pass.

A rejected turn may move to another credential's socket only if it is self-contained (docs/architecture.md#replay-safety):
no `previous_response_id` (that state lives on this socket's account), or one that names a
warm-up of this socket (`generate: false`, empty input: no conversation state), which is then
dropped from the moved copy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .after_output import AfterOutput
from .body_edit import remove_members
from .classifier import BootstrapClassifier, Decision
from .framer import Event
from .replay_safety import assess, nobody, removals
from .rules import Rules
from .vocabulary import STATE_LOST, Verdict

Message = tuple[bytes, bool]  # (content, is_text), exactly as received
PREVIOUS = "previous_response_id"
PREVIOUS_NOT_FOUND = "previous_response_not_found"


@dataclass
class Turn:
    n: int  # 1-based, on this client socket
    create: Message  # the client's response.create, as sent
    body: dict[str, Any]
    movable: bool  # may go to another credential's socket
    why_pinned: str | None = None
    warmup: bool = False  # generate:false with empty input: establishes no conversation state
    warmup_id: str | None = None  # its previous_response_id names only a warm-up: dropped when moved
    strip: bool = False  # carries encrypted reasoning that another account cannot read
    stays_home: bool = False  # self-contained, yet bound to one account (compaction, pin)
    response_id: str | None = None
    bound_to: str | None = None  # stays_home: the credential key that made its state (None: the client's own)

    def message_for(self, new_socket: bool, foreign: bool) -> Message:
        """The create to send: on a new socket without a warm-up's id, and to an account other than
        the client's without encrypted reasoning and the client's turn state (as the HTTP path
        does). Only those members are cut from the client's bytes (body_edit); the rest, Responses
        Lite's `client_metadata` among it, is sent exactly as Codex sent it."""
        cuts: list[tuple[dict[str, Any], str]] = []
        continues = PREVIOUS in self.body
        if new_socket and self.warmup_id is not None:
            cuts.append((self.body, PREVIOUS))
            continues = False
        encrypted = len([i for i in self.body.get("input") or () if isinstance(i, dict)
                         and i.get("type") == "reasoning" and i.get("encrypted_content")])
        strip = list(range(encrypted)) if foreign and self.strip and not continues else []
        cuts += removals(self.body, strip, foreign)
        if not cuts:
            return self.create
        raw = self.create[0] if isinstance(self.create[0], bytes) else self.create[0].encode()
        return remove_members(raw, self.body, cuts), True


@dataclass(frozen=True)
class Step:
    """What the shell does with a server message (or with time passing, or the upstream closing)."""

    release: tuple[Message, ...] = ()  # deliver to the client now, in order
    decision: Decision | None = None  # set when a window just closed
    held: tuple[Message, ...] = ()  # a FAILOVER's swallowed messages (delivered on exhaustion)
    after_output: bool = False  # the FAILOVER is a rejection after the turn's output began


def parse_create(content: bytes | str) -> dict[str, Any] | None:
    """A client message's JSON body when it is a `response.create`, else None."""
    text = content if isinstance(content, str) else content.decode("utf-8", "replace")
    if '"response.create"' not in text:  # cheap: most client traffic is not a create
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return body if isinstance(body, dict) and body.get("type") == "response.create" else None


@dataclass
class TurnGate:
    rules: Rules
    timeout: float = 0.0  # the bootstrap time budget (0: none)
    clock: Callable[[], float] = time.monotonic
    encrypted_reasoning: str = "strip"
    owner: Callable[[tuple[str, ...]], str | None] = nobody  # who made an artifact (provenance.Provenance.owner)
    stall: float = 0.0  # first_event_timeout: a hold past `timeout` goes on while the upstream is not this silent
    max_hold: float = 0.0  # ...and this long at most (classifier.py; 0: commit at `timeout`)
    turns: int = 0
    turn: Turn | None = None  # the latest turn
    _clf: BootstrapClassifier | None = None  # open window
    _held: list[Message] = field(default_factory=list)
    _warmups: dict[str, dict[str, Any]] = field(default_factory=dict)  # response id -> warm-up body
    _after: AfterOutput | None = None  # the committed turn's response, watched for a rejection after its output

    # -- client side -----------------------------------------------------------------------

    def client_message(self, content: bytes, is_text: bool, headers: Mapping[str, str]) -> Turn | None:
        """A `response.create` opens a window and returns its turn; anything else passes."""
        body = parse_create(content) if is_text else None
        if body is None:
            return None
        self.turns += 1
        turn = self._turn(self.turns, (content, is_text), body, headers)
        if self._clf is not None:
            # The previous turn is still held: its window goes on and covers this one too (nothing
            # held is dropped); such an overlap cannot tell whose rejection it sees, so it never moves.
            turn.movable, turn.why_pinned = False, "sent while the previous turn was still held"
            self.turn = turn
            return turn
        self.turn = turn
        self.reopen()
        return turn

    def _turn(self, n: int, create: Message, body: dict[str, Any], headers: Mapping[str, str]) -> Turn:
        previous = body.get(PREVIOUS)
        warmup = body.get("generate") is False and body.get("input") == [] and not previous
        warm = self._warmups.get(previous) if isinstance(previous, str) else None
        if warm is not None and _covers(body, warm):
            # Only a warm-up precedes it: the turn carries everything; it moves without the id.
            alone = {k: v for k, v in body.items() if k != PREVIOUS}
            policy = assess(alone, headers, self.encrypted_reasoning, self.owner)
            return Turn(n, create, body, policy.movable, policy.why_pinned, warmup, previous, policy.strip_reasoning,
                        stays_home=not policy.movable, bound_to=policy.bound_to)
        policy = assess(body, headers, self.encrypted_reasoning, self.owner)
        if previous:
            why = "carries previous_response_id: it continues a response on this socket's account"
            return Turn(n, create, body, False, why, warmup)
        return Turn(n, create, body, policy.movable, policy.why_pinned, warmup, None, policy.strip_reasoning,
                    stays_home=not policy.movable, bound_to=policy.bound_to)

    def abandon(self) -> tuple[Message, ...]:
        """Close the window without a decision (the turn was never sent); returns what it held."""
        held, self._held, self._clf = tuple(self._held), [], None
        return held

    def reopen(self) -> None:
        """A fresh window for the current turn (a new turn, or the same one on a new socket)."""
        self._clf = BootstrapClassifier(self.rules, timeout=self.timeout, clock=self.clock, stall=self.stall,
                                        max_hold=self.max_hold)
        self._held, self._after = [], None
        if self.turn is not None:
            self.turn.response_id = None  # the next socket names its own response

    # -- server side -----------------------------------------------------------------------

    @property
    def holding(self) -> bool:
        return self._clf is not None

    @property
    def deadline(self) -> float | None:
        return self._clf.deadline if self._clf is not None else None

    def server_message(self, content: bytes, is_text: bool) -> Step:
        message = (content, is_text)
        if self._clf is None:  # the hot path: passed on as is, parsed only when it may be a rejection
            if self._wants_response_id():
                self._note_response_id(Event.from_ws_message(content))
            late = self._late_rejection(message) if self._after is not None else None
            return late or Step(release=(message,))
        event = Event.from_ws_message(content)
        if self._wants_response_id():
            self._note_response_id(event)
        self._held.append(message)
        return self._settle(self._clf.feed(event))

    def tick(self) -> Step:
        return self._settle(self._clf.tick()) if self._clf is not None else Step()

    def upstream_closed(self) -> Step:
        """The upstream socket ended. Inside a window nothing useful came: a rejection."""
        return self._settle(self._clf.end()) if self._clf is not None else Step()

    def _settle(self, decision: Decision) -> Step:
        if not decision.final:
            return Step()
        held, self._held, self._clf = tuple(self._held), [], None
        if lost_state(self.turn, decision):
            decision = Decision(Verdict.FAILOVER, STATE_LOST, decision.trigger, decision.error)
        if decision.verdict is Verdict.FAILOVER:
            return Step(decision=decision, held=held)
        self._after = AfterOutput(self.rules) if decision.verdict is Verdict.COMMIT else None
        return Step(release=held, decision=decision)

    def _late_rejection(self, message: Message) -> Step | None:
        """A committed turn's message: a rejection after its output began, while no item of the turn but
        reasoning has completed, is not delivered (core/after_output.py, the rule both transports
        follow): the turn ends in a close Codex retries (core/turn_machine.py)."""
        after = self._after
        assert after is not None
        content = message[0]
        raw = content.encode() if isinstance(content, str) else content
        decision = after.see(raw, lambda: Event.from_ws_message(content).payload)
        if not after.watching:
            self._after = None
        if decision is None:
            return None
        return Step(decision=decision, held=(message,), after_output=True)

    def _wants_response_id(self) -> bool:
        """Only a warm-up's response id matters (a later turn may name it)."""
        return self.turn is not None and self.turn.warmup and self.turn.response_id is None

    def _note_response_id(self, event: Event) -> None:
        turn, payload = self.turn, event.payload
        if turn is None or not isinstance(payload, dict) or not event.type or not event.type.startswith("response."):
            return  # (a `type` comes only with a JSON object; the turn is there when it is wanted)
        response = payload.get("response")
        rid = response.get("id") if isinstance(response, dict) else None
        if isinstance(rid, str):
            turn.response_id = rid
            self._warmups[rid] = turn.body


def lost_state(turn: Turn | None, decision: Decision) -> bool:
    """The turn named a response its socket does not hold (`previous_response_not_found`: the
    service keeps a turn's state per connection, and a socket the gate moved holds none of the old
    one's). Such a turn is never ended: Codex is told to reconnect, and re-sends its full input on
    the new socket (request_machine.settle_turn)."""
    if turn is None or not turn.body.get(PREVIOUS) or decision.verdict is not Verdict.DELIVER:
        return False
    return str((decision.error or {}).get("code") or "").lower() == PREVIOUS_NOT_FOUND


def _covers(body: dict[str, Any], warmup: dict[str, Any]) -> bool:
    """The turn sets every field the warm-up set (so dropping the warm-up loses nothing)."""
    skip = {"generate", "input", PREVIOUS, "client_metadata"}
    return all(k in skip or k in body for k in warmup)
