"""The user-facing scripts run end to end (smoke tests: they must not rot)."""

import shutil
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


# The smoke runs below mostly wait on their paced fakes: they are started together, each writing to
# its own files, and each test reads its own (a third of the suite's time they took one by one).
# Each has its own temporary folders and ports, so running side by side changes nothing they check.
SMOKES = {
    "demo": [ROOT / "scripts" / "demo.py"],
    "failover": [ROOT / "scripts" / "measure_failover.py", "--runs", "2"],
    "framer": [ROOT / "scripts" / "bench_framer.py", "--quick", "--repeat", "1"],
    "affinity": [ROOT / "scripts" / "measure_affinity.py", "--sessions", "6", "--turns", "4"],
    "websocket": [ROOT / "scripts" / "measure_websocket.py", "--quick"],
    "bench": [ROOT / "scripts" / "bench.py", "--quick", "--pool-only", "--png"],  # + the chart's path (the fixture's folder)
    "session": [ROOT / "scripts" / "bench.py", "--session", "--turns", "2", "4", "--sessions", "1", "--rtt-ms", "0",
                "--uplink-mbit", "1000"],
}
if shutil.which("redis-server"):
    SMOKES["stores"] = [ROOT / "scripts" / "bench.py", "--stores", "--requests", "4"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`smoke(name)`: the stdout of SMOKES[name], all of which were started at once."""
    folder = tmp_path_factory.mktemp("smokes")
    procs = {}
    for name, argv in SMOKES.items():
        argv = [*argv, folder / "bench.png"] if name == "bench" else argv
        out, err = open(folder / f"{name}.out", "w"), open(folder / f"{name}.err", "w")
        procs[name] = (subprocess.Popen([sys.executable, *map(str, argv)], stdout=out, stderr=err, text=True, cwd=ROOT),
                       out, err)

    def result(name: str, timeout: float = 300) -> str:
        proc, out, err = procs[name]
        proc.wait(timeout)
        out.close()
        err.close()
        assert proc.returncode == 0, (folder / f"{name}.err").read_text()[-2000:]
        return (folder / f"{name}.out").read_text()

    result.folder = folder  # type: ignore[attr-defined]
    yield result
    for proc, out, err in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        out.close()
        err.close()


def test_demo_shows_a_failover_and_an_exhaustion(smoke):
    out = smoke("demo")
    assert "client got HTTP 200" in out, out[-2000:]
    assert "'error' events: 0" in out, out[-2000:]
    assert "Hello from sk-test-spare2-good" in out, out[-2000:]
    assert "verdict=commit" in out, out[-2000:]
    assert "client got HTTP 503" in out, out[-2000:]


def test_measure_failover_prints_its_table(smoke):
    out = smoke("failover")
    assert "addon, own credential overloaded" in out, out[-2000:]
    assert "no proxy" in out, out[-2000:]


def test_bench_framer_quick(smoke):
    out = smoke("framer")
    assert "event counts agree" in out


def test_measure_affinity_moves_only_the_sessions_of_the_overloaded_credential(smoke):
    out = smoke("affinity")
    on = next(line for line in out.splitlines() if line.startswith("on "))
    _, turns, changes, overloads, homed = on.split()
    assert int(overloads) == 1
    assert int(changes) == int(homed) >= 1


def test_setup_explains_when_no_suitable_python_exists(tmp_path):
    import shutil

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup", tmp_path / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "no-pyenv")}
    fake_py = tmp_path / "bin" / "python3"  # a Python that is too old
    fake_py.parent.mkdir()
    fake_py.write_text("#!/bin/sh\nexit 1\n")
    fake_py.chmod(0o755)
    env["PATH"] = f"{fake_py.parent}:/usr/bin:/bin"  # the system's own python3 here is 3.11
    for candidate in ("python3.13", "python3.12", "python3", "python"):
        found = shutil.which(candidate, path="/usr/bin:/bin")
        ok = found and subprocess.run([found, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"]).returncode == 0
        if ok:
            pytest.skip(f"{found} is a Python >= 3.12: this machine cannot show the message")
    proc = subprocess.run(["/bin/bash", str(tmp_path / "scripts" / "setup")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "no Python >= 3.12 found" in proc.stderr, proc.stdout + proc.stderr
    assert "CODEX_FAILOVER_PYTHON" in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / ".venv").exists()


def test_bench_quick_runs_side_by_side(smoke):
    out = smoke("bench")
    tmp_path = smoke.folder
    assert "(a) plain mitmdump" in out, out[-2000:]
    assert "(b) addon, healthy" in out, out[-2000:]
    assert "(p) addon, pool only" in out and "CPU ms/req" in out, out[-2000:]  # pool-only mode, CPU per request
    assert "goals:" in out, out[-2000:]
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_measure_websocket_prints_its_table(smoke):
    out = smoke("websocket")
    assert "(c) gate, healthy credential" in out, out[-2000:]
    assert "rejected, moved to the spare" in out, out[-2000:]
    assert "gate / passthrough (medians)" in out, out[-2000:]
    assert "messages/s" in out, out[-2000:]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_bench_stores_compares_the_three_stores_side_by_side(smoke):
    out = smoke("stores")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"memory", "sqlite", "redis"}
    assert all(r[1] == "4" for r in rows.values())


def test_bench_session_uploads_less_on_the_websocket_as_the_session_grows(smoke):
    out = smoke("session")
    rows = {" ".join(line.split()[:3]): line.split() for line in out.splitlines() if line.startswith(("HTTP", "WebSocket"))}
    assert set(rows) == {"HTTP/SSE, 2 req", "WebSocket, 2 req", "HTTP/SSE, 4 req", "WebSocket, 4 req"}, out
    assert 1.0 < float(rows["HTTP/SSE, 2 req"][4]) < float(rows["HTTP/SSE, 4 req"][4]), out  # x the gate's bytes
