"""Installing and loading: the addon's dependency check, the pin, and scripts/setup's extras.

A mitmproxy without one of the runtime dependencies, or of another version, must stop at once with one
line saying what to install (no traceback, no proxy listening, a non-zero status). These tests build such
a mitmproxy offline: a pip-less venv in tmp_path whose .pth files put the project venv's site-packages on
sys.path, then hide a module (sys.modules[name] = None makes its import fail) or fake mitmproxy's version.
"""

import ast
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADDON = ROOT / "addon" / "failover.py"
LOADING = re.compile(r"\[\d\d:\d\d:\d\d\.\d{3}\] Loading script addon/failover\.py")


def failover_constant(name):
    """A module-level constant of addon/failover.py, read without running the file."""
    for node in ast.parse(ADDON.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {ADDON}")


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- the pin and the requirements ---------------------------------------------------------------------


def test_the_addons_requirements_are_pyprojects_runtime_dependencies():
    assert list(failover_constant("REQUIREMENTS").values()) == pyproject()["project"]["dependencies"]


def entry():
    """addon/failover.py's functions, run without the addon it loads at the end."""
    source = ADDON.read_text().split("_problem = dependency_problem()")[0]
    namespace = {"__file__": str(ADDON), "__name__": "failover_entry"}
    exec(compile(source, str(ADDON), "exec"), namespace)
    return namespace


def test_mitmproxy_is_pinned_to_the_range_of_the_releases_the_seam_was_tested_on():
    import mitmproxy.version

    from codex_failover.mitm import fallbacks

    pins = [d for d in pyproject()["project"]["dependencies"] if d.startswith("mitmproxy")]
    assert pins == [failover_constant("REQUIREMENTS")["mitmproxy"]]
    assert re.fullmatch(r"mitmproxy>=\d+(\.\d+)*,<\d+(\.\d+)*", pins[0])
    in_range = entry()["in_range"]
    assert all(in_range(v) for v in fallbacks.TESTED)
    low, high = pins[0][len("mitmproxy>="):].split(",<")
    assert fallbacks.TESTED[0].startswith(low)  # the range's ends are the tested releases' ends
    assert fallbacks.TESTED[-1].rsplit(".", 1)[0] < high
    assert mitmproxy.version.VERSION in fallbacks.TESTED  # the project venv runs a tested release


@pytest.mark.parametrize("version, inside", [
    ("11.1.3", False), ("12.0.0", True), ("12.2.3", True), ("12.3.1", True), ("12.3.17", True),
    ("12.4.0", False), ("13.0.0rc1", False), ("12", True)])
def test_the_entrys_range_check(version, inside):
    assert entry()["in_range"](version) is inside


@pytest.mark.parametrize("version, starts", [("11.1.3", False), ("12.0.0", True), ("12.4.0", True), ("12.9.1", True),
                                             ("13.0.0", False)])
def test_the_entry_starts_on_any_mitmproxy_12(version, starts):
    namespace = entry()
    assert namespace["in_range"](version, namespace["RUNS_ON"]) is starts


def test_every_module_the_addon_checks_for_imports_here():
    import importlib

    for module in failover_constant("REQUIREMENTS"):
        importlib.import_module(module)


# --- a mitmproxy that lacks something -----------------------------------------------------------------


def mitmproxy_env(tmp_path, *pth_lines):
    """A python whose site-packages are the project venv's, after running `pth_lines` at start-up."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    project_site = sysconfig.get_path("purelib")
    (Path(site) / "a_project.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    (Path(site) / "b_broken.pth").write_text("".join(f"{line}\n" for line in pth_lines))
    return python


def mitmdump(python, tmp_path):
    confdir = tmp_path / "confdir"
    confdir.mkdir(exist_ok=True)
    return subprocess.run(
        [python, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()",
         "--set", f"confdir={confdir}", "--listen-host", "127.0.0.1", "-p", "0", "-s", "addon/failover.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=30)


def assert_stops_with(proc, line):
    out = proc.stdout.splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr == line + "\n", proc.stderr
    assert len(out) <= 1, proc.stdout
    assert all(LOADING.fullmatch(x) for x in out), proc.stdout  # mitmproxy's own line
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "listening" not in proc.stdout + proc.stderr


RUN = " (or run scripts/run, which sets up .venv)"
PIN = failover_constant("REQUIREMENTS")["mitmproxy"]


@pytest.mark.parametrize("pth, problem, install", [
    ('import sys; sys.modules["yaml"] = None',
     "missing dependency: PyYAML", "install it with: {py} -m pip install 'PyYAML>=6.0'"),
    ('import sys; sys.modules["yaml"] = sys.modules["python_socks"] = None',
     "missing dependencies: PyYAML, python-socks[asyncio]",
     "install them with: {py} -m pip install 'PyYAML>=6.0' 'python-socks[asyncio]>=2.4'"),
    ('import sys; sys.modules["python_socks.async_.asyncio"] = None',  # python-socks without its asyncio part
     "missing dependency: python-socks[asyncio]", "install it with: {py} -m pip install 'python-socks[asyncio]>=2.4'"),
])
def test_a_missing_dependency_stops_mitmdump_with_one_line(tmp_path, pth, problem, install):
    python = mitmproxy_env(tmp_path, pth)
    proc = mitmdump(python, tmp_path)
    assert_stops_with(proc, f"codex-failover: {problem}; {install.format(py=shlex.quote(str(python)))}{RUN}")


def test_another_mitmproxy_version_stops_mitmdump_with_one_line(tmp_path):
    # mitmproxy 11.0.0 itself swallows a SystemExit raised while a script loads; the addon exits regardless
    python = mitmproxy_env(tmp_path, 'import mitmproxy.version; mitmproxy.version.VERSION = "11.0.0"')
    proc = mitmdump(python, tmp_path)
    assert_stops_with(proc, f"codex-failover: needs mitmproxy>=12.0,<13, this is mitmproxy 11.0.0; "
                            f"install it with: {shlex.quote(str(python))} -m pip install {shlex.quote(PIN)}{RUN}")


def test_another_version_and_missing_dependencies_make_one_line_too(tmp_path):
    python = mitmproxy_env(tmp_path, 'import mitmproxy.version; mitmproxy.version.VERSION = "11.0.0"',
                           'import sys; sys.modules["yaml"] = None')
    proc = mitmdump(python, tmp_path)
    assert_stops_with(proc, f"codex-failover: needs mitmproxy>=12.0,<13, this is mitmproxy 11.0.0; "
                            f"missing dependency: PyYAML; install them with: {shlex.quote(str(python))} -m pip "
                            f"install {shlex.quote(PIN)} 'PyYAML>=6.0'{RUN}")


def test_a_standalone_mitmproxy_is_told_to_use_a_pip_installed_one(tmp_path):
    python = mitmproxy_env(tmp_path, 'import sys; sys.frozen = True; sys.modules["yaml"] = None')
    proc = mitmdump(python, tmp_path)
    assert_stops_with(proc, f"codex-failover: missing dependency: PyYAML; this mitmproxy is a standalone build, "
                            f"which cannot load them: install codex-failover with pip (pip install {shlex.quote(str(ROOT))}) "
                            f"and use the mitmdump it brings{RUN}")


# --- scripts/setup: which extras, and when it installs ------------------------------------------------

FAKE_PYTHON = """#!/bin/bash
# Stands in for python: answers setup's questions and logs what it is asked to do.
case "$1" in
    -c) exit 0 ;;
    --version) echo "Python 3.12.0" ;;
    -m) case "$2" in
            venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
                  printf '#!/bin/sh\\necho "mitmdump $*" >> "$FAKE_PY_LOG"\\n' > "$3/bin/mitmdump"
                  chmod +x "$3/bin/mitmdump"; echo venv >> "$FAKE_PY_LOG" ;;
            *) m="$2"; shift 2; echo "$m $*" >> "$FAKE_PY_LOG"
               if [ "$m" = pip ] && [ -n "${FAKE_PIP_FAILS:-}" ]; then exit 1; fi ;;
        esac ;;
esac
"""


@pytest.fixture
def project(tmp_path):
    """A copy of the project's scripts and pyproject.toml, with a stand-in python; run(...) runs a script
    and returns what it asked of python (venv, pip, pytest) and mitmdump."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup", "run", "test"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)  # with its mode: scripts call each other
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "log"

    def run(script, *args, **env):
        log.write_text("")
        full_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CODEX_FAILOVER_PYTHON": str(fake),
                    "FAKE_PY_LOG": str(log), **env}
        proc = subprocess.run(["/bin/bash", str(root / "scripts" / script), *args], env=full_env,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return log.read_text().splitlines()

    run.root = root
    return run


def installs(calls):
    """The extras of the `pip install -e` call, None when there was none; '' for runtime only."""
    specs = [c.split(" -e ", 1)[1] for c in calls if c.startswith("pip install") and " -e " in c]
    assert len(specs) <= 1, calls
    if not specs:
        return None
    return specs[0][specs[0].index("[") + 1:-1] if specs[0].endswith("]") else ""


def test_run_installs_only_the_runtime_dependencies_and_test_adds_test_and_bench(project):
    root = project.root
    calls = project("run", "-p", "9090")
    assert calls[0] == "venv"
    assert installs(calls) == ""
    assert calls[-1] == f"mitmdump --listen-host 127.0.0.1 -p 8080 -s {root}/addon/failover.py -p 9090"
    assert project("run") == [f"mitmdump --listen-host 127.0.0.1 -p 8080 -s {root}/addon/failover.py"]

    calls = project("test", "-q")
    assert installs(calls) == "bench,test"
    assert calls[-3:] == ["ruff check addon tests scripts", "mypy ", "pytest -n 2 --dist loadfile -q"]  # the linters first
    assert (root / ".venv" / ".installed-from").read_text() == (root / "pyproject.toml").read_text().rstrip(
        "\n") + " extras=bench,test"


def test_a_venv_with_more_extras_than_asked_for_is_up_to_date(project):
    assert installs(project("setup", "test,bench")) == "bench,test"
    for args, env in [(("none",), {}), (("test",), {}), (("bench, test",), {}), ((), {}),
                      ((), {"CODEX_FAILOVER_EXTRAS": "bench"})]:
        assert project("setup", *args, **env) == [], (args, env)
    assert project("test") == ["ruff check addon tests scripts", "mypy ", "pytest -n 2 --dist loadfile"]
    assert installs(project("run")) is None


def test_setup_installs_only_what_is_missing_and_keeps_extras_when_pyproject_changes(project):
    assert installs(project("setup", "none")) == ""
    assert installs(project("setup", "none")) is None
    assert installs(project("setup", "test")) == "test"
    assert installs(project("setup", "bench")) == "bench,test"  # everything installed stays recorded
    assert installs(project("setup", "test,bench")) is None
    with open(project.root / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    assert installs(project("setup", "none")) == "bench,test"  # reinstalled, extras and all
    assert installs(project("setup")) is None


def test_offline_after_a_pyproject_change_setup_keeps_the_venv_it_has(project):
    """A comment changed in pyproject.toml, and no network (a proxy's own machine may have none):
    scripts/run still starts the proxy with the .venv it has, saying so in one line."""
    assert installs(project("setup", "none")) == ""
    with open(project.root / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    calls = project("run", FAKE_PIP_FAILS="1")
    assert calls[-1].startswith("mitmdump "), calls


def test_an_update_under_a_services_environment_uses_the_venvs_own_python(project):
    """After a `git pull` changed pyproject.toml, the service (systemd's environment: PATH=/usr/bin:/bin,
    no CODEX_FAILOVER_PYTHON, a Python >= 3.12 only in pyenv) restarts scripts/run: the update is made
    with the .venv's interpreter, and the proxy starts (before: "no Python >= 3.12 found", exit 1)."""
    assert installs(project("setup", "none")) == ""
    with open(project.root / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    calls = project("run", CODEX_FAILOVER_PYTHON="")
    assert installs(calls) == "" and calls[-1].startswith("mitmdump "), calls


def test_setup_reads_the_stamp_an_older_setup_wrote(project):
    """The stamp format is unchanged: a .venv set up before (`<pyproject> extras=test,bench`) is up to date."""
    assert installs(project("setup", "none")) == ""
    stamp = project.root / ".venv" / ".installed-from"
    stamp.write_text((project.root / "pyproject.toml").read_text().rstrip("\n") + " extras=test,bench")
    assert project("setup") == []
    assert project("test") == ["ruff check addon tests scripts", "mypy ", "pytest -n 2 --dist loadfile"]


# --- the Python version, and a pipx install -----------------------------------------------------------


def test_the_python_the_entry_asks_for_is_pyprojects():
    want = failover_constant("PYTHON_MIN")
    assert pyproject()["project"]["requires-python"] == ">=" + ".".join(map(str, want))


def older_python() -> Path:
    """A Python older than 3.12 (pyenv's, where the machine has one), else a skip."""
    import glob
    import os

    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(glob.glob(str(root / "versions" / "3.1[01].*" / "bin" / "python")) +
                   [p for p in (shutil.which("python3.11"), shutil.which("python3.10")) if p])
    if not found:
        pytest.skip("no Python 3.10 or 3.11 on this machine (pyenv or PATH)")
    return Path(found[-1])


def problem_on(python: Path, tmp_path: Path, pipx: bool) -> str:
    """addon/failover.py's one line, run by `python` in a venv (a pipx one: with pipx_metadata.json,
    named `mitmproxy` as pipx names it) whose mitmproxy is 11.0.2 (a stand-in module)."""
    venv = tmp_path / "pipx" / "venvs" / "mitmproxy"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    if pipx:
        (venv / "pipx_metadata.json").write_text("{}")
    fake = tmp_path / "fake" / "mitmproxy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "version.py").write_text('VERSION = "11.0.2"\n')
    code = ("src = open(%r).read().split('_problem = dependency_problem()')[0]\n"
            "ns = {'__file__': %r, '__name__': 'entry'}\n"
            "exec(compile(src, %r, 'exec'), ns)\nprint(ns['dependency_problem']())") % ((str(ADDON),) * 3)
    done = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, timeout=30,
                          env={"PYTHONPATH": str(fake.parent), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_on_an_older_python_the_line_names_it_and_gives_pipxs_commands(tmp_path):
    """Debian 12's pipx: Python 3.11, whose `pipx install mitmproxy` gives mitmproxy 11."""
    python = older_python()
    line = problem_on(python, tmp_path, pipx=True)
    minor = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True, check=True, timeout=30).stdout.strip()
    others = " ".join(shlex.quote(r.split(";")[0].strip()) for m, r in failover_constant("REQUIREMENTS").items()
                      if m != "mitmproxy")
    assert line.startswith(f"codex-failover: mitmproxy 12 needs Python >= 3.12, this is Python {minor}; "
                           f"needs mitmproxy>=12.0,<13, this is mitmproxy 11.0.2; missing dependencies: "), line
    assert line.endswith(f"; this mitmproxy is a pipx install: reinstall it on Python 3.12 or newer with its "
                         f"dependencies: pipx install --force --python python3.12 {shlex.quote(PIN)} && "
                         f"pipx inject mitmproxy {others}{RUN}"), line
    assert "pip install" not in line  # a pipx venv has no pip of its own


def test_on_an_older_python_without_pipx_the_line_says_to_make_a_newer_venv(tmp_path):
    line = problem_on(older_python(), tmp_path, pipx=False)
    assert "mitmproxy 12 needs Python >= 3.12, this is Python 3.1" in line
    assert "make a venv with Python 3.12 or newer and install them there: python3.12 -m venv ~/.venvs/mitmproxy && " \
           f"~/.venvs/mitmproxy/bin/pip install {shlex.quote(PIN)} 'PyYAML>=6.0'" in line, line


def test_a_pipx_mitmproxy_missing_a_dependency_is_told_to_inject_it(tmp_path):
    python = mitmproxy_env(tmp_path, 'import sys; sys.modules["yaml"] = None')
    (python.parent.parent / "pipx_metadata.json").write_text("{}")
    proc = mitmdump(python, tmp_path)
    assert_stops_with(proc, f"codex-failover: missing dependency: PyYAML; this mitmproxy is a pipx install: add it "
                            f"with: pipx inject env 'PyYAML>=6.0'{RUN}")


# --- pip install <clone>: a command to run, and the rules as package data ------------------------------


def test_pip_install_of_a_clone_gives_a_command_that_starts_a_proxy_with_its_rules(tmp_path):
    """Offline: the package built from a copy of the clone (no network: --no-index, no dependencies, the
    project venv's setuptools), into a venv that sees the project venv's dependencies. Its rules are
    package data, found from anywhere; `codex-failover` starts mitmdump with the addon, which answers."""
    import json
    import os
    import socket
    import time
    import urllib.request

    clone = tmp_path / "clone"  # (a copy: pip builds in the source tree)
    clone.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "rules", clone / "rules")
    shutil.copytree(ROOT / "addon", clone / "addon", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    (Path(site) / "z_project.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
           "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
                           "--no-build-isolation", str(clone)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found = subprocess.run([venv / "bin" / "python", "-c", "import codex_failover.rules_file as r, json; "
                            "print(json.dumps([str(r.DEFAULT_RULES_PATH), r.load_rules().source]))"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    path, source = json.loads(found.stdout)
    assert path.startswith(site) and path.endswith("codex_failover/rules/default.yaml") and source == path
    assert (Path(site) / "codex_failover" / "rules" / "pool.example.yaml").is_file()
    assert (Path(site) / "codex_failover" / "dashboard" / "dashboard.js").is_file()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    confdir = tmp_path / "confdir"
    proc = subprocess.Popen([venv / "bin" / "codex-failover", "-p", str(port), "--set", f"confdir={confdir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))
        deadline, doc = time.monotonic() + 30, None
        while doc is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                doc = json.loads(opener.open("http://codex-failover.status/", timeout=5).read())
            except OSError:
                time.sleep(0.2)
        assert doc is not None and doc["credentials"] == [], proc.poll()
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=15)[0]
    assert "codex-failover: pool (no file)" in out and "Traceback" not in out, out
    module = subprocess.run([venv / "bin" / "python", "-m", "codex_failover", "--version"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=tmp_path)
    assert module.returncode == 0 and "Mitmproxy:" in module.stdout, module.stdout + module.stderr


def check_in_process(preamble: str = "") -> tuple[str, bool]:
    """addon/failover.py's dependency check run by this venv's python after `preamble`: its line
    (or None) and whether it imported redis."""
    code = (preamble + "\nimport sys\nsrc = open(%r).read().split('_problem = dependency_problem()')[0]\n"
            "ns = {'__file__': %r, '__name__': 'entry'}\nexec(compile(src, %r, 'exec'), ns)\n"
            "print(ns['dependency_problem']()); print(bool(sys.modules.get('redis')))") % ((str(ADDON),) * 3)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    line, imported = done.stdout.strip().splitlines()
    return line, imported == "True"


def test_the_check_finds_redis_without_importing_it():
    """redis is used only for a Redis state store; importing it at start cost every proxy 6.5 MiB."""
    assert check_in_process() == ("None", False)


def test_a_missing_redis_is_still_named():
    line, _ = check_in_process('import sys; sys.modules["redis"] = None')
    assert "missing dependency: redis" in line, line
