"""What a gated socket tells: each turn's attempt and each move, in the log and in its flow's comment."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from mitmproxy import http

from ..core import story
from ..core.activity import WEBSOCKET, Activity, RequestRecord, session_tag, usage_tokens
from ..core.vocabulary import Verdict
from ..core.ws_turns import Turn
from .dial import Upstream

log = logging.getLogger("codex_failover")


@dataclass(eq=False)
class SocketStory:
    """What a gated socket tells: each turn's attempt and each move, in the log and in its flow's
    comment (the last HISTORY_LINES of them)."""

    sid: str
    flow: http.HTTPFlow
    history: deque[str]
    activity: Activity | None = None  # the dashboard's recent requests
    session: str | None = None  # the client's session (its tag is on each line)
    record: RequestRecord | None = field(default=None, init=False)  # the latest turn's, on the dashboard
    _opened: float = field(default=0.0, init=False)

    @property
    def tag(self) -> str:
        return session_tag(self.session)

    def opened(self, up: Upstream) -> None:
        """The socket's first upstream: in the flow's comment; the log's line for the socket is its
        end's (turns, moves), each turn's its verdict."""
        self.note(f"socket on {up.cand.name} via {up.route}", logging.DEBUG)

    def turn(self, turn: Turn, on: str) -> None:
        """A turn opened on credential `on`'s socket. A warm-up (`generate: false`, nothing asked) is not
        a request anyone made: it is neither listed nor logged as a turn. A pin is news only when a
        rejection could not move it (the gate's _decided, _exhausted): a debug line here."""
        log.debug("[%s] turn %d on %s%s", self.sid, turn.n, on, "" if turn.movable else f" (cannot move: {turn.why_pinned})")
        self._opened = time.monotonic()
        if self.activity is None or turn.warmup:
            self.record = None
            return
        self.record = self.activity.start(f"{self.sid}-t{turn.n}", time.time(), self.session, turn.body.get("model"),
                                          WEBSOCKET)

    def message(self, content: bytes | str) -> None:
        """A message from upstream: `response.completed` carries the turn's token counts."""
        raw = content.encode() if isinstance(content, str) else content
        if self.record is None or b'"response.completed"' not in raw:
            return
        try:
            tokens = usage_tokens(json.loads(raw))
        except ValueError:
            return
        if tokens is not None:
            self.record.tokens_from = lambda: tokens

    def attempt(self, up: Upstream, turn: Turn | None, verdict: str, reason: str) -> None:
        n = turn.n if turn else 0
        line = f"turn {n}: {up.cand.name} via {up.route}: {verdict} ({reason})"
        self.history.append(line)
        ok = verdict in (Verdict.COMMIT, Verdict.DELIVER)
        up.leg.judge_socket(story.mark(verdict, reason, ok), line)
        warmup = turn is not None and turn.warmup and ok
        log.log(logging.DEBUG if warmup else logging.INFO, "[%s] turn %d credential=%s route=%s verdict=%s reason=%s "
                "session=%s", self.sid, n, up.cand.name, up.route.replace(" ", "="), verdict, reason, self.tag)
        if self.record is not None and self.activity is not None and not warmup:
            self.activity.attempt(self.record, up.cand.name, verdict, reason)
            if ok:
                self.activity.first_output(self.record, (time.monotonic() - self._opened) * 1000)
        self._comment()

    def note(self, text: str, level: int = logging.INFO) -> None:
        self.history.append(text)
        log.log(level, "[%s] %s session=%s", self.sid, text, self.tag)
        self._comment()

    def ended(self, elapsed: float, turns: int, moves: int) -> None:
        log.info("[%s] websocket ended after %.1fs, %d turn(s), %d move(s) session=%s", self.sid, elapsed, turns, moves,
                 self.tag)

    def _comment(self) -> None:
        # The latest first (mitmweb's Comment column shows the start), then one line per event.
        latest = self.history[-1] if self.history else "open"
        self.flow.comment = f"websocket {self.sid}: {latest}\n" + "\n".join(f"• {line}" for line in self.history)
