"""The chaos suite's reduced run (the full one: scripts/chaos)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_reduced_chaos_suite_passes():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--reduced"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "FAIL" not in proc.stdout
    assert "passed" in proc.stdout, proc.stdout + proc.stderr
