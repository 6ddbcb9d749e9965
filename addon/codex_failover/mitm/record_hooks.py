"""A direct attempt's record flow: its hooks, once the verdict says it did not serve (direct.py).

Why a module of its own: the record's moments come from two sides (the layers: head sent, head in,
ended; the run: the verdict), and its hooks must run in an attempt's order, each once, never in the
middle of the step that got there, and never for a served attempt, whose record is the client's flow
(docs/architecture.md#the-direct-attempt).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from mitmproxy import flow as mitmflow, hooks

from .hook_chain import run_hook

if TYPE_CHECKING:
    from .direct import DirectAttempt


class RecordHooks:
    """The record flow's hooks, in an attempt's order, once the verdict says it did not serve (a served
    attempt's record is the client's own flow: no hook, docs/architecture.md#the-direct-attempt). Each
    moment after the verdict (judged, ended) asks for one loop callback (never in the middle of the
    layers' or the run's step that got there), which runs whatever hooks are due, in an eager task (a
    hook that does not wait needs no loop turn). No timer waits for the verdict: a run that ends gives
    its attempt one if it had none (`request_run.start_run`), and a cancel does."""

    def __init__(self, attempt: DirectAttempt):
        self.attempt = attempt
        self.started = False  # the attempt started (DirectAttempt.start): its record shows no secret
        self.stage = SENT_HOOKS  # the hooks run so far (`_due`)
        self._step_due = self._hooking = False  # a callback asked for / hooks running now
        self._task: asyncio.Task | None = None  # the hooks running now (a task the loop holds only weakly)

    def moved(self) -> None:
        """Something happened: the due hooks run at the loop's next turn. Not before the attempt started
        (its record holds the real credentials until then), nor without a running loop (a verdict given
        from synchronous code: the next moment on the loop picks it up)."""
        attempt = self.attempt
        if self.stage >= DONE:
            if attempt.ended.is_set() and attempt.registry is not None:  # a served one: in flight until it ended
                attempt.registry.pop(attempt.flow.id, None)
            return
        if self._step_due or not self.started:
            return
        if self.stage == SENT_HOOKS and not self._hooking:
            if attempt.served:  # nothing to show: the client's flow is its record
                return self._finish()
            if not attempt.judged.is_set():
                return  # nothing is due before the verdict
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._step_due = True
        loop.call_soon(self._step)

    def _step(self) -> None:
        self._step_due = False
        if not self._hooking:  # (else the hooks running now see it after the one they await)
            self._task = asyncio.Task(self._hooks(), loop=asyncio.get_running_loop(), eager_start=True)

    async def _hooks(self) -> None:
        self._hooking = True
        try:
            while (hook := self._due()) is not None:
                await run_hook(hook)
        except BaseException:
            self.stage = DONE
            self.attempt.over.set()
            raise
        finally:
            self._hooking = False

    def _due(self) -> hooks.Hook | None:
        """The record's next hook, once what it follows happened (None: not yet, or none left)."""
        attempt = self.attempt
        ended, flow = attempt.ended.is_set(), attempt.flow
        if self.stage == SENT_HOOKS:
            if attempt.served:
                self._finish()
                return None
            if not attempt.judged.is_set():  # shown once the verdict says how it ended
                return None
            if not (attempt.sent or ended):
                return None
            attempt.settle()
            self.stage = REQUEST_HOOK
            return hooks.all_hooks["requestheaders"](flow)
        if self.stage == REQUEST_HOOK:
            self.stage = HEAD_HOOK
            return hooks.all_hooks["request"](flow)
        if self.stage == HEAD_HOOK:
            if flow.response is None and not ended:
                return None
            self.stage = END_WAIT
            if flow.response is not None:
                return hooks.all_hooks["responseheaders"](flow)
        if self.stage == END_WAIT:
            if not ended:
                return None
            attempt._keep_capture()
            if flow.response is not None and flow.response.timestamp_end is None:
                flow.response.timestamp_end = time.time()
            self.stage = FINAL_HOOK
            if attempt.verdict_error is not None or flow.error is not None:
                flow.error = mitmflow.Error(attempt.verdict_error or flow.error.msg)
                return hooks.all_hooks["error"](flow)
            return hooks.all_hooks["response"](flow)
        if self.stage == FINAL_HOOK:
            self.stage = DONE
            attempt.over.set()
        return None

    def _finish(self) -> None:
        """A served attempt's record: no hook (the client's flow shows it); out of the attempts in flight
        once its stream ended (`moved`)."""
        self.stage = DONE
        self.attempt.over.set()
        self.moved()


# RecordHooks' stages: before requestheaders (waiting for the verdict), request, responseheaders, waiting
# for the end, the final hook running, all done.
SENT_HOOKS, REQUEST_HOOK, HEAD_HOOK, END_WAIT, FINAL_HOOK, DONE = range(6)


class Signal(asyncio.Event):
    """A direct attempt's `ended` and `judged`: also move its record's hooks on."""

    def __init__(self, record: RecordHooks):
        super().__init__()
        self._record = record

    def set(self) -> None:
        super().set()
        self._record.moved()
