"""codex-failover: the mitmproxy entry point.

    mitmdump -s addon/failover.py [--set failover_config=pool.yaml]

Everything lives in the `codex_failover` package next to this file. Before importing it, this file
checks that the mitmproxy loading it has every runtime dependency and is a mitmproxy 12;
when not, it prints one line saying what to install and stops mitmproxy (exit status 2).
"""

from __future__ import annotations  # this file must run on any mitmproxy's Python, to say what is wrong

import os
import sys

# The runtime dependencies exactly as pyproject.toml lists them (tests/test_install.py keeps the two
# in step): the module each one provides -> its requirement.
REQUIREMENTS = {
    # The releases the seam's contract tests pass on (mitm/fallbacks.py lists them): the attempt engine drives
    # mitmproxy's ConnectionHandler and HttpLayer, whose shape is mitmproxy 12's.
    "mitmproxy": "mitmproxy>=12.0,<12.4",
    "yaml": "PyYAML>=6.0",
    "python_socks.async_.asyncio": "python-socks[asyncio]>=2.4",
    "wsproto": "wsproto>=1.2",
    "certifi": "certifi",
    "prometheus_client": "prometheus-client>=0.20",
    "redis": "redis>=5.0",
    # zstd bodies (Codex's ChatGPT mode): the standard library's from Python 3.14 (compression.zstd), this before.
    "backports.zstd": "backports.zstd>=1.0; python_version < '3.14'",
}
# Looked for, not imported: used only where the pool file asks for it (a Redis state store), and importing
# it at start cost every proxy 6.5 MiB of memory (docs/measurements.md, issue 45's budget).
FOUND_ONLY = ("redis",)
MITMPROXY_RANGE = REQUIREMENTS["mitmproxy"][len("mitmproxy"):]
# What it starts on: any mitmproxy 12. A release outside the pinned range (the tested ones) runs on every
# fallback of the seam (mitm/fallbacks.py), slower, and says so in one line; mitmproxy 13 may move the names the
# seam's modules import, so it is refused, as any other major release.
RUNS_ON = ">=12.0,<13"
# mitmproxy 12 (and this package: pyproject.toml's requires-python) needs Python 3.12 or newer.
PYTHON_MIN = (3, 12)
EXIT_MISSING_DEPENDENCIES = 2

_here = os.path.dirname(os.path.abspath(__file__))


def _name(requirement: str) -> str:
    """'python-socks[asyncio]>=2.4' -> 'python-socks[asyncio]'."""
    for i, c in enumerate(requirement):
        if c in "<>=!~; ":
            return requirement[:i]
    return requirement


def _release(version: str) -> tuple[int, ...]:
    """'12.3.1' -> (12, 3, 1), '12.0' -> (12, 0, 0); a pre-release's suffix is dropped ('13.0.0rc1' -> (13, 0, 0))."""
    parts = []
    for part in version.split("."):
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def _applies(requirement: str) -> bool:
    """Is `requirement` for this Python? Its marker, if any, is `python_version < 'X.Y'`."""
    _, _, marker = requirement.partition(";")
    if not marker.strip():
        return True
    name, op, value = marker.split()
    if (name, op) != ("python_version", "<"):
        raise ValueError(f"unsupported marker {marker!r}")
    return sys.version_info[:2] < tuple(int(x) for x in value.strip("'\"").split("."))


def in_range(version: str, spec: str = MITMPROXY_RANGE) -> bool:
    """Does `version` satisfy `spec`, a comma-separated list of `>=X` and `<Y` clauses?"""
    have = _release(version)
    for clause in spec.split(","):
        if clause.startswith(">="):
            if have < _release(clause[2:]):
                return False
        elif clause.startswith("<"):
            if have >= _release(clause[1:]):
                return False
        else:
            raise ValueError(f"unsupported clause {clause!r}")
    return True


def dependency_problem() -> str | None:
    """None when every runtime dependency imports and mitmproxy is a mitmproxy 12, else the one
    line to print: what is wrong and the command that fixes it."""
    import importlib
    import importlib.util
    import shlex

    missing = []
    for module, requirement in REQUIREMENTS.items():
        if not _applies(requirement):
            continue
        try:
            if module not in FOUND_ONLY:
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                raise ImportError(module)
        except Exception:  # ImportError, or an install too broken to import: either way, install it
            missing.append(requirement)
    wrong_version = None
    if REQUIREMENTS["mitmproxy"] not in missing:
        try:
            from mitmproxy.version import VERSION
        except Exception:
            VERSION = "unknown"
        if not in_range(VERSION, RUNS_ON):
            wrong_version = VERSION
    if not missing and wrong_version is None:
        return None

    problems, to_install = [], list(missing)
    if wrong_version is not None:
        problems.append(f"needs mitmproxy{RUNS_ON}, this is mitmproxy {wrong_version}")
        to_install.insert(0, REQUIREMENTS["mitmproxy"])
    if missing:
        names = ", ".join(_name(r) for r in missing)
        problems.append(f"missing {'dependencies' if len(missing) > 1 else 'dependency'}: {names}")
    old_python = sys.version_info[:2] < PYTHON_MIN
    want = ".".join(map(str, PYTHON_MIN))
    if old_python:  # no mitmproxy 12 installs here: the Python is the problem
        problems.insert(0, f"mitmproxy 12 needs Python >= {want}, this is Python {sys.version_info[0]}.{sys.version_info[1]}")
    them = "them" if len(to_install) > 1 else "it"

    run = os.path.join(os.path.dirname(_here), "scripts", "run")
    if os.path.exists(run):
        rel = os.path.relpath(run)
        alternative = f" (or run {run if rel.startswith('..') else rel}, which sets up .venv)"
    else:
        alternative = ""
    if getattr(sys, "frozen", False):  # mitmproxy's standalone binaries cannot load extra packages
        fix = (f"this mitmproxy is a standalone build, which cannot load them: install codex-failover with pip "
               f"(pip install {shlex.quote(os.path.dirname(_here))}) and use the mitmdump it brings")
        return f"codex-failover: {'; '.join(problems)}; {fix}{alternative}"
    quoted = " ".join(shlex.quote(r) for r in to_install)
    if os.path.isfile(os.path.join(sys.prefix, "pipx_metadata.json")):  # a pipx install: its venv has no pip
        venv = os.path.basename(sys.prefix)
        others = " ".join(shlex.quote(r.split(";")[0].strip()) for m, r in REQUIREMENTS.items() if m != "mitmproxy")
        if old_python or REQUIREMENTS["mitmproxy"] in to_install:
            python = f" --python python{want}" if old_python else ""
            fix = (f"this mitmproxy is a pipx install: reinstall it{f' on Python {want} or newer' if old_python else ''} "
                   f"with its dependencies: pipx install --force{python} {shlex.quote(REQUIREMENTS['mitmproxy'])} && "
                   f"pipx inject {shlex.quote(venv)} {others}")
        else:
            fix = f"this mitmproxy is a pipx install: add {them} with: pipx inject {shlex.quote(venv)} {quoted}"
        return f"codex-failover: {'; '.join(problems)}; {fix}{alternative}"
    if old_python:
        every = " ".join(shlex.quote(r.split(";")[0].strip()) for r in REQUIREMENTS.values())
        fix = (f"make a venv with Python {want} or newer and install them there: python{want} -m venv "
               f"~/.venvs/mitmproxy && ~/.venvs/mitmproxy/bin/pip install {every} (then run "
               f"~/.venvs/mitmproxy/bin/mitmdump)")
        return f"codex-failover: {'; '.join(problems)}; {fix}{alternative}"
    pip = f"{shlex.quote(sys.executable)} -m pip install {quoted}"
    return f"codex-failover: {'; '.join(problems)}; install {them} with: {pip}{alternative}"


_problem = dependency_problem()
if _problem is not None:  # one line, no traceback, and mitmproxy stops with a non-zero status
    sys.stdout.flush()
    print(_problem, file=sys.stderr, flush=True)
    _mitmproxy = sys.modules.get("mitmproxy.version")
    if _mitmproxy is not None and not in_range(getattr(_mitmproxy, "VERSION", "0"), RUNS_ON):
        # Other mitmproxy versions (11.0.0, for one) swallow a SystemExit raised while a script loads
        # (load_script returns from its `finally`) and would go on as a proxy without the addon.
        os._exit(EXIT_MISSING_DEPENDENCIES)
    raise SystemExit(EXIT_MISSING_DEPENDENCIES)  # mitmproxy 12 lets it through: mitmdump exits at once

if _here not in sys.path:  # works without installing the package, too
    sys.path.insert(0, _here)

from codex_failover.mitm.addon import FailoverAddon  # noqa: E402

addons = [FailoverAddon()]
