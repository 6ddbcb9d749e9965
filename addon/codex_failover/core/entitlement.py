"""Which credential lacks which model: a plan without the model said so (`model_not_entitled`, e.g. 400
"The '<model>' model is not supported when using Codex with a ChatGPT account", 404 `model_not_found`).
Pure, clock injected.

Such an answer says nothing about the credential's other models, so it never cools the credential:
the pair (credential, model) is remembered instead, the planner skips that credential for that model
only (without dialling it), and the pair is forgotten after `keep` seconds (a plan can change), or when
the credential's auth changes. Bounded: at most `max_entries` pairs, the oldest forgotten first."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

KEEP = 3600.0  # a plan's models are asked again after an hour
MAX_ENTRIES = 4096
MAX_MODEL = 200  # a model name longer than this is not remembered (hostile input stays bounded)


class ModelBook:
    def __init__(self, keep: float = KEEP, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.time):
        self.keep, self.max_entries, self._clock = keep, max_entries, clock
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def not_entitled(self, key: str, model: str | None) -> bool:
        """Credential `key` said it lacks `model`; False when there is no model to remember."""
        if not model or len(model) > MAX_MODEL or self.keep <= 0:
            return False
        pair = (key, model)
        self._until.pop(pair, None)
        self._until[pair] = self._clock() + self.keep
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)
        return True

    def lacks(self, key: str, model: str | None) -> bool:
        """Is `key` known not to be entitled to `model` (now)?"""
        if not model:
            return False
        until = self._until.get((key, model))
        if until is None:
            return False
        if until <= self._clock():
            del self._until[(key, model)]
            return False
        return True

    def forget(self, key: str) -> None:
        """The credential changed (its auth file, its key): what it lacked is asked again."""
        for pair in [p for p in self._until if p[0] == key]:
            del self._until[pair]

    def entries(self) -> list[tuple[str, str, float]]:
        """(credential key, model, until) of every pair remembered now."""
        now = self._clock()
        return [(key, model, until) for (key, model), until in self._until.items() if until > now]
