"""core/run_log.py: each attempt's line, and the one pointer to what the reasons mean."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from codex_failover.core import run_log
from codex_failover.core.planner import Candidate
from codex_failover.core.vocabulary import Verdict


def attempt(n: int) -> SimpleNamespace:
    return SimpleNamespace(n=n, started=time.monotonic(), endpoint=None, judge=lambda mark, comment, error: None)


def test_the_pointer_to_the_reasons_follows_the_first_attempt_that_failed_over_not_a_client_that_left(
        caplog, monkeypatch):
    monkeypatch.setattr(run_log, "_explained", False)
    log = run_log.RunLog("r1", SimpleNamespace(comment=""), total=2)
    own = Candidate("client", "client", None, None, True)
    with caplog.at_level(logging.INFO, logger="codex_failover"):
        log.record(attempt(1), own, Verdict.CANCELLED, "client_gone", None)
        assert [r.getMessage() for r in caplog.records if run_log.WHY in r.getMessage()] == [], \
            "nothing failed over: the client left"
        log.record(attempt(2), own, Verdict.FAILOVER, "overloaded", 200)
        log.record(attempt(2), own, Verdict.FAILOVER, "overloaded", 200)
    pointers = [r.getMessage() for r in caplog.records if run_log.WHY in r.getMessage()]
    assert len(pointers) == 1 and pointers[0].startswith("[r1] (why an attempt failed over"), pointers


@pytest.fixture(autouse=True)
def _quiet_tell(monkeypatch):
    monkeypatch.setattr(run_log.RunLog, "tell", lambda self, *a, **k: None)
