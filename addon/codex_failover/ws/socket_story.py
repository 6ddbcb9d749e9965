"""What a gated socket tells: each turn's attempt and each move, in the log and in its flow's comment."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from mitmproxy import http

from ..core import story
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

    def attempt(self, up: Upstream, turn: Turn | None, verdict: str, reason: str) -> None:
        n = turn.n if turn else 0
        line = f"turn {n}: {up.cand.name} via {up.route}: {verdict} ({reason})"
        self.history.append(line)
        up.leg.judge(story.mark(verdict, reason, verdict in (Verdict.COMMIT, Verdict.DELIVER)), line)
        log.info("[%s] turn %d credential=%s route=%s verdict=%s reason=%s", self.sid, n, up.cand.name,
                 up.route.replace(" ", "="), verdict, reason)
        self._comment()

    def note(self, text: str) -> None:
        self.history.append(text)
        log.info("[%s] %s", self.sid, text)
        self._comment()

    def ended(self, elapsed: float, turns: int, moves: int) -> None:
        log.info("[%s] websocket ended after %.1fs, %d turn(s), %d move(s)", self.sid, elapsed, turns, moves)

    def _comment(self) -> None:
        self.flow.comment = f"codex-failover websocket {self.sid}:\n" + "\n".join(self.history)
