"""The user-facing scripts run end to end (smoke tests: they must not rot)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def run(*argv, timeout=120):
    proc = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_demo_shows_a_failover_and_an_exhaustion():
    out = run(ROOT / "scripts" / "demo.py")
    assert "client got HTTP 200" in out and "'error' events: 0" in out and "Hello from sk-test-spare2-good" in out
    assert "verdict=commit" in out and "client got HTTP 503" in out


def test_measure_failover_prints_its_table():
    out = run(ROOT / "scripts" / "measure_failover.py", "--runs", "2")
    assert "addon, own credential overloaded" in out and "no proxy" in out


def test_bench_framer_quick():
    out = run(ROOT / "scripts" / "bench_framer.py", "--quick", "--repeat", "1", timeout=300)
    assert "event counts agree" in out


def test_measure_affinity_moves_only_the_sessions_of_the_overloaded_credential():
    out = run(ROOT / "scripts" / "measure_affinity.py", "--sessions", "6", "--turns", "4")
    on = next(line for line in out.splitlines() if line.startswith("on "))
    _, turns, changes, overloads, homed = on.split()
    assert int(overloads) == 1 and int(changes) == int(homed) >= 1
