"""A smoke run of `scripts/bench --cost` (e2e): every configuration (pool-only mode's too) measured in every
phase, the proxies on a CPU of their own with `--pin` when the host has two, the figures in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


def test_bench_cost_measures_every_cell(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_cost.py"), "--sessions", "10", "--requests", "25",
                           "--idle", "0.5", "--json", str(tmp_path / "cost.json"),
                           "--pin", "--block", "20", "--baseline", str(ROOT / "addon" / "failover.py"), "--pool-only"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pinned = len(os.sched_getaffinity(0)) >= 2
    assert ("proxies on CPU" in proc.stdout) == pinned and "turns of 20 requests" in proc.stdout, proc.stdout
    figures = json.loads((tmp_path / "cost.json").read_text())["figures"]
    base = next(k for k in figures if k.startswith("base-") and not k.endswith("pool-only"))
    assert set(figures) == {"plain", "script", "addon", base, "pool-only", f"{base} pool-only"}
    for cfg, cells in figures.items():
        for phase in ("fresh", "after 10"):
            for length in ("short", "long"):
                assert 0 < cells[f"{phase} {length}"] < 1000, (cfg, phase, length, cells)  # ms of CPU a request
        assert cells["idle ms/s"] >= 0 and cells["rss fresh"] > 10


def test_bench_ab_compares_checkouts_over_several_processes(tmp_path):
    """`scripts/bench --ab`: each configuration as several processes, every one measured, a ratio to
    plain mitmdump's; a path that is no addon is one clear line."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ab.py"), str(ROOT / "addon" / "failover.py"),
                           "--requests", "40", "--instances", "2", "--block", "10", "--json", str(tmp_path / "ab.json")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 processes per configuration, turns of 10 requests" in proc.stdout, proc.stdout
    figures = json.loads((tmp_path / "ab.json").read_text())["figures"]
    assert len(figures) == 2 and figures["plain"]["ratio"] == 1.0
    for cells in figures.values():
        assert 0 < cells["median"] < 1000 and cells["turns"] == 4
    other = tmp_path / "other" / "addon"
    other.mkdir(parents=True)
    (other / "codex_failover").mkdir()
    (other / "failover.py").write_text("x = 1\n")  # loads, but is no addon: it would measure as plain
    for argv, said in (([str(tmp_path / "nothing.py")], "no such file"),
                       ([str(ROOT / "scripts" / "bench.py")], "not a checkout's addon/failover.py"),
                       ([str(ROOT / "addon" / "failover.py")] * 2, "named twice"),
                       ([str(other / "failover.py"), "--requests", "10"], "did not load as the addon")):
        bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ab.py"), *argv],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and said in bad.stderr, (argv, bad.stderr)


def test_bench_where_splits_the_addons_cpu_a_request_by_function_against_plain():
    """`scripts/bench --where`: both proxies sample their own CPU; every measured request is counted
    and the addon's own functions show in the inclusive table."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_where.py"), "--requests", "120",
                           "--warm-up", "20", "--top", "60"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("CPU a request: plain ") and "120 short streams each" in proc.stdout, proc.stdout
    inclusive = proc.stdout.split("Inclusive")[1].split("Self")[0]
    assert "mitm/addon.py:FailoverAddon.request" in inclusive, proc.stdout
