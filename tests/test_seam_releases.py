"""The seam's contract tests on the other mitmproxy releases it claims (mitm/fallbacks.py TESTED).

The project venv runs them on its own release with the rest of the suite; here each other release
gets a venv of its own, cached and reused (CODEX_FAILOVER_CODEX_CACHE, else
~/.cache/codex-failover-tests, as the Codex CLI's), holding that mitmproxy, the runtime dependencies
and pytest, with this checkout's addon/ on its path; the contract tests run in it as a subprocess.

Which releases: CODEX_FAILOVER_MITMPROXY_RELEASES, a comma-separated list or `all` (every TESTED
release but the project venv's); by default the oldest, so a plain run checks both ends of the range.
`scripts/test-mitmproxy` runs them all. Where a release cannot be installed (no package index), the
test is skipped with why, except in CI.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import mitmproxy.version
import pytest

from codex_failover.mitm import fallbacks

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("CODEX_FAILOVER_CODEX_CACHE", Path.home() / ".cache" / "codex-failover-tests"))
CONTRACT_TESTS = ["tests/test_warm_conn_contract.py", "tests/test_held_stream.py",
                  "tests/test_ws_layer_socket.py"]
INSTALL_TIMEOUT = 300.0
RUN_TIMEOUT = 300.0


def releases() -> list[str]:
    asked = os.environ.get("CODEX_FAILOVER_MITMPROXY_RELEASES", "").strip()
    others = [v for v in fallbacks.TESTED if v != mitmproxy.version.VERSION]
    if asked == "all":
        return others
    if asked:
        return [v.strip() for v in asked.split(",") if v.strip()]
    return others[:1]


def _skip_or_fail(why: str):
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def venv_for(release: str) -> Path:
    """A venv with mitmproxy `release` and what the contract tests import; built once, under a lock."""
    target = CACHE / f"mitmproxy-{release}"
    python = target / "bin" / "python"
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = [f"mitmproxy=={release}", *(r for r in requirements if not r.startswith("mitmproxy")),
              "pytest>=8", "pytest-mock>=3.12", "hypothesis>=6.100"]
    stamp = "\n".join(wanted)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".install.lock", "w") as lock:
        deadline = time.monotonic() + INSTALL_TIMEOUT + 30
        while True:  # another run may be building it: a bounded wait
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _skip_or_fail(f"another process holds {CACHE / '.install.lock'} for too long")
                time.sleep(0.5)
        if python.exists() and (target / ".installed").exists() and (target / ".installed").read_text() == stamp:
            return python
        staging = CACHE / f".staging-mitmproxy-{release}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True, capture_output=True, timeout=120)
            res = subprocess.run([str(staging / "bin" / "python"), "-m", "pip", "install", "-q",
                                  "--disable-pip-version-check", *wanted],
                                 capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            shutil.rmtree(staging, ignore_errors=True)
            _skip_or_fail(f"installing mitmproxy {release} took longer than {INSTALL_TIMEOUT:.0f}s")
        if res.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            _skip_or_fail(f"pip could not install mitmproxy {release}: {res.stderr.strip()[-400:]}")
        (staging / ".installed").write_text(stamp)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # only a complete venv ever sits at `target`; its scripts are not used
    return python


@pytest.mark.parametrize("release", releases())
def test_the_seams_contract_tests_pass_on(release):
    python = venv_for(release)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'addon'}{os.pathsep}{ROOT / 'tests' / 'support'}"}
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-W", "ignore::DeprecationWarning", *CONTRACT_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    version = subprocess.run([str(python), "-c", "import mitmproxy.version as v; print(v.VERSION)"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version == release
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "failed" not in res.stdout, res.stdout[-2000:]
