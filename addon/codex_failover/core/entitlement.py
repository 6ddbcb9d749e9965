"""Which credential lacks which model: a plan without the model said so (`model_not_entitled`, e.g. 400
"The '<model>' model is not supported when using Codex with a ChatGPT account", 404 `model_not_found`).
Pure, clock injected.

Such an answer says nothing about the credential's other models, so it never cools the credential:
the pair (credential, model) is remembered instead, the planner skips that credential for that model
only (without dialling it), and the pair is forgotten after `keep` seconds (a plan can change), or when
the credential's auth changes. Bounded: at most `max_entries` pairs, the oldest forgotten first.

It also knows which models some credential served (`known`): a model nobody was seen serving that one
credential lacks and one more lacks is likely no model at all (a typo), so the request stops moving and
the client gets the service's own answer (failover_loop); a model known to exist keeps moving to the
credential whose plan has it."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

KEEP = 3600.0  # a plan's models are asked again after an hour
MAX_ENTRIES = 4096
MAX_MODEL = 200  # a model name longer than this is not remembered (hostile input stays bounded)
# A model none was seen serving that this many credentials said they lack is likely no model at all (a
# typo): the request (or turn) stops moving and the client gets the service's answer.
UNKNOWN_MODEL_TRIES = 2


class ModelBook:
    def __init__(self, keep: float = KEEP, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.time):
        self.keep, self.max_entries, self._clock = keep, max_entries, clock
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._served: OrderedDict[str, float] = OrderedDict()  # model -> when a credential last served it

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

    def served(self, key: str, model: str | None) -> None:
        """Credential `key` served `model`: it lacks it no more, and the model is known to exist."""
        if not model or len(model) > MAX_MODEL:
            return
        self._until.pop((key, model), None)
        self._served.pop(model, None)
        self._served[model] = self._clock()
        while len(self._served) > self.max_entries:
            self._served.popitem(last=False)

    def known(self, model: str | None) -> bool:
        """Was `model` served by some credential (since the start, within the last `max_entries` models)?
        A model none was seen serving may be a typo: it moves once at most (failover_loop)."""
        return bool(model) and model in self._served

    def lacking(self, model: str | None) -> int:
        """How many credentials are remembered (now) as lacking `model`."""
        now = self._clock()
        return sum(1 for (_, m), until in self._until.items() if m == model and until > now)

    def likely_no_model(self, model: str | None, lacked: int) -> bool:
        """`lacked` credentials said they lack `model`, and none was seen serving it: stop moving."""
        return lacked >= UNKNOWN_MODEL_TRIES and not self.known(model)

    def forget(self, key: str) -> None:
        """The credential changed (its auth file, its key): what it lacked is asked again."""
        for pair in [p for p in self._until if p[0] == key]:
            del self._until[pair]

    def entries(self) -> list[tuple[str, str, float]]:
        """(credential key, model, until) of every pair remembered now."""
        now = self._clock()
        return [(key, model, until) for (key, model), until in self._until.items() if until > now]
