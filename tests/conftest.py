import sys
from pathlib import Path

import pytest

# Test support (the fake upstream, processes, clients) lives in tests/support/; the demo and the
# measurement scripts use it too.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from codex_failover.rules_file import load_rules

# Copies of ../shared/fixtures (wire/ and live-codex-0.169/), vendored so a clean clone tests alone.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
WIRE = FIXTURES / "wire"
LIVE = FIXTURES / "live"


@pytest.fixture(autouse=True, scope="module")
def _stop_leftover_processes():
    """A test that fails halfway (or forgets) leaves no fake upstream or proxy running past its
    module (module scope: some modules share one proxy between their tests)."""
    yield
    from harness import stop_leftovers

    stop_leftovers()


_UNSET = object()


@pytest.fixture(autouse=True)
def _no_master_left_behind():
    """mitmproxy's `ctx.master` (and `ctx.options`, `ctx.log`) is whichever master was made last, and stays after
    its test: a later test whose hooks run without a master of its own would meet it (its addons, the
    log lines it kept, their frames). Each test gets back what it started with."""
    from mitmproxy import ctx

    before = {name: getattr(ctx, name, _UNSET) for name in ("master", "options", "log")}
    yield
    for name, value in before.items():
        if value is _UNSET:
            ctx.__dict__.pop(name, None)
        else:
            setattr(ctx, name, value)


@pytest.fixture(scope="session")
def rules():
    return load_rules()


class Clock:
    """An injectable clock that only moves when a test moves it."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake(tmp_path):
    """The fake upstream on 127.0.0.1 (fast pace; stalls last 30 s), stopped by its PID."""
    from harness import FakeUpstreamProcess

    upstream = FakeUpstreamProcess(tmp_path, "--pace", "0.002", "--deltas", "8", "--stall", "30")
    yield upstream
    upstream.stop()


@pytest.fixture
def tls_fake(tmp_path):
    """The fake upstream behind TLS (self-signed): the client reaches it through a CONNECT tunnel."""
    from harness import FakeUpstreamProcess

    upstream = FakeUpstreamProcess(tmp_path / "fake", "--tls", "--pace", "0.002", "--deltas", "5")
    upstream.base = f"https://127.0.0.1:{upstream.port}"
    yield upstream
    upstream.stop()


@pytest.fixture
def start_proxy(tmp_path):
    """`start_proxy(fake, creds, routes=None, extra=(), env_extra=None, **policy)`: a real mitmdump with the addon,
    its pool the API-key credentials `creds` ((name, key[, route]), served by `fake`), `routes`
    and policy overrides; stopped (by PID) after the test."""
    from harness import ProxyProcess, pool_yaml

    procs = []

    def start(fake, creds, routes=None, extra=(), env_extra=None, **policy):
        text, env = pool_yaml(fake.base, creds, routes, **policy)
        proxy = ProxyProcess(tmp_path / f"proxy{len(procs)}", text, {**env, **(env_extra or {})}, extra=list(extra))
        procs.append(proxy)
        return proxy

    yield start
    for proc in procs:
        proc.stop()
