"""The real Codex CLI through a real `mitmdump -s addon/failover.py`, against the fake upstream.

`codex exec` runs in API-key mode with the client's own key overloaded (`sk-test-client-overload`,
an in-stream `server_is_overloaded`); the pool holds one healthy spare. The turn must complete with
the spare's answer, and Codex must never see an error.

Codex comes from npm (`@openai/codex`, version CODEX_VERSION, cached in CODEX_CACHE and reused);
the test is skipped when node/npm are missing or the install fails. Nothing else leaves the machine:

- Codex gets a clean environment: a temporary CODEX_HOME and HOME, `CODEX_API_KEY`, and
  HTTP(S)_PROXY/ALL_PROXY pointing at mitmdump, `CODEX_CA_CERTIFICATE` = mitmdump's CA.
- mitmdump (with `failover_intercept=all`)'s `map_remote` rewrites every URL whose host is not 127.0.0.1 to the fake upstream
  (api.openai.com, chatgpt.com's model catalog and plugin list, api.github.com, the OTel metrics
  endpoint ab.chatgpt.com...). 127.0.0.1 is left alone: the addon's loopback relay and the pool's
  base_url live there.
- In mitmproxy 12.3.1 the script addon's `request` hook runs BEFORE map_remote (ScriptLoader sits
  ahead of MapRemote in the default addon list). So the addon recognises Codex's POST by its real
  URL, https://api.openai.com/v1/responses; its attempts are client replays, which run every addon
  again, so map_remote sends the client-credential attempt to the fake, and the spare's attempt goes
  to the pool's base_url (the fake) directly.
- A recorder addon (written to the temp dir, loaded as a second `-s`) logs every request Codex asked
  for, every answer and every upstream connection mitmdump made; the test asserts that each upstream
  connection went to 127.0.0.1.

Override the Codex version with CODEX_FAILOVER_CODEX_VERSION (e.g. 0.171.0) and the cache with
CODEX_FAILOVER_CODEX_CACHE.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness import FakeUpstreamProcess, MitmwebProcess, ProxyProcess, pool_yaml

pytestmark = pytest.mark.e2e

# 0.171.0 is the newest release (Responses Lite, remote compaction v2); 0.169.0, which the wire facts in
# tests/fixtures/live come from, still runs: CODEX_FAILOVER_CODEX_VERSION=0.169.0.
CODEX_VERSION = os.environ.get("CODEX_FAILOVER_CODEX_VERSION", "0.171.0")
CODEX_CACHE = Path(os.environ.get("CODEX_FAILOVER_CODEX_CACHE", Path.home() / ".cache" / "codex-failover-tests"))
INSTALL_TIMEOUT = 300.0
CODEX_TIMEOUT = 90.0
CLIENT_KEY = "sk-test-client-overload"
SPARE_KEY = "sk-test-spare-good"

RECORDER = r'''
"""Test-only mitmproxy addon: one JSON line per request asked, answer given, upstream connection made."""
import json
import os
import time


class Recorder:
    def __init__(self):
        self.out = open(os.environ["CODEX_TEST_RECORD"], "a", buffering=1)

    def _write(self, **record):
        record["t"] = time.time()
        self.out.write(json.dumps(record) + "\n")

    def server_connect(self, data):
        address = data.server.address
        self._write(kind="server_connect", host=address[0] if address else None, port=address[1] if address else None)

    def requestheaders(self, flow):  # before any request hook: the URL the client asked for
        self._write(kind="request", replay=bool(flow.is_replay), method=flow.request.method, url=flow.request.pretty_url,
                    http_version=flow.request.http_version, upgrade=flow.request.headers.get("upgrade", ""))

    def _done(self, kind, flow):
        self._write(kind=kind, replay=bool(flow.is_replay), method=flow.request.method, url=flow.request.pretty_url,
                    status=flow.response.status_code if flow.response else None,
                    error=flow.error.msg if flow.error else None)

    def response(self, flow):
        self._done("response", flow)

    def error(self, flow):
        self._done("error", flow)


addons = [Recorder()]
'''


# -- installing the real Codex CLI ----------------------------------------------------------------


def _run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill that group (by its id) and raise."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run_many(cmd: list[str], count: int, tmp_path: Path, env: dict, codex_home: Path, work: Path,
                auth_json: dict | None) -> list[subprocess.CompletedProcess]:
    """`count` Codex processes at once, each in its own CODEX_HOME and work folder (its own session),
    each in its own process group, all waited for within CODEX_TIMEOUT (killed by group id after it)."""
    procs = []
    try:
        for i in range(count):
            home, folder = tmp_path / f"codex-home-{i}", tmp_path / f"work-{i}"
            home.mkdir(exist_ok=True)
            folder.mkdir(exist_ok=True)
            if auth_json is not None:
                (home / "auth.json").write_text(json.dumps(auth_json))
            argv = [str(folder) if a == str(work) else a for a in cmd]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                          text=True, start_new_session=True, env={**env, "CODEX_HOME": str(home)},
                                          cwd=folder))
        deadline = time.monotonic() + CODEX_TIMEOUT
        done = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=10)


def _codex_works(binary: Path, node_dir: str) -> str | None:
    """`codex --version` output if the installed binary runs, else None."""
    if not binary.exists():
        return None
    try:
        res = _run_bounded([str(binary), "--version"], 30, env={"PATH": f"{node_dir}:/usr/bin:/bin", "HOME": "/nonexistent"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 and "codex" in res.stdout else None


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("the real Codex CLI test needs node and npm on PATH (npm install @openai/codex)")
    node_dir = str(Path(node).parent)
    target = CODEX_CACHE / f"codex-{CODEX_VERSION}"
    binary = target / "node_modules" / ".bin" / "codex"
    CODEX_CACHE.mkdir(parents=True, exist_ok=True)
    with open(CODEX_CACHE / ".install.lock", "w") as lock:
        deadline = time.monotonic() + INSTALL_TIMEOUT + 30
        while True:  # another test run may be installing the same version: bounded wait
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(f"another process holds {CODEX_CACHE / '.install.lock'} for too long")
                time.sleep(0.5)
        if _codex_works(binary, node_dir) is None:
            started = time.monotonic()
            staging = CODEX_CACHE / f".staging-{CODEX_VERSION}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                res = _run_bounded([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--no-save",
                                    "--loglevel=error", f"@openai/codex@{CODEX_VERSION}"], INSTALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                shutil.rmtree(staging, ignore_errors=True)
                pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} took longer than {INSTALL_TIMEOUT:.0f}s")
            if res.returncode != 0:
                shutil.rmtree(staging, ignore_errors=True)
                pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} failed ({res.returncode}): {res.stderr.strip()[-500:]}")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)  # only a complete install ever sits at `target`
            print(f"\n[codex-cli] installed @openai/codex@{CODEX_VERSION} in {time.monotonic() - started:.1f}s -> {target}")
        version = _codex_works(binary, node_dir)
    if version is None:
        pytest.skip(f"@openai/codex@{CODEX_VERSION} installed in {target} but `codex --version` does not run here")
    help_text = _run_bounded([str(binary), "exec", "--help"], 30,
                             env={"PATH": f"{node_dir}:/usr/bin:/bin", "HOME": "/nonexistent"}).stdout
    missing = [flag for flag in ("--json", "--skip-git-repo-check", "--sandbox", "--cd") if flag not in help_text]
    if missing:
        pytest.fail(f"{version}: `codex exec --help` lacks {missing}; this test needs updating for it")
    return binary


# -- the scenario ---------------------------------------------------------------------------------


def _events(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@dataclass
class CodexRun:
    """One `codex exec` through mitmdump with the addon, against the fake upstream."""

    run: subprocess.CompletedProcess
    took: float
    records: list[dict]  # what the recorder saw
    fake: FakeUpstreamProcess
    proxy_log: str
    session_start: int = 0  # where in proxy_log the lines written while Codex ran begin
    runs: list[subprocess.CompletedProcess] = field(default_factory=list)  # every session's (run_codex's `sessions`)

    @property
    def session_log(self) -> list[str]:
        """The proxy's log lines from Codex's start to its end (start-up lines left out)."""
        return self.proxy_log[self.session_start:].splitlines()

    @property
    def events(self) -> list[dict]:
        return _events(self.run.stdout)

    @property
    def asked(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "request" and not r["replay"]]

    @property
    def context(self) -> str:
        fake_log = self.fake.log_path.read_text() if self.fake.log_path.exists() else ""
        return (f"\n--- codex stdout ---\n{self.run.stdout}\n--- codex stderr ---\n{self.run.stderr[-3000:]}"
                f"\n--- mitmdump log ---\n{self.proxy_log[-6000:]}\n--- fake log ---\n{fake_log}")

    def assert_completed_with(self, key: str, reconnects: int = 0) -> None:
        """Exit 0, `key`'s answer, no error of any kind (but `reconnects` of Codex's own notices that it
        re-sends a stream that ended early), the turn completed."""
        events, context = self.events, self.context
        notices = [e for e in events if e.get("type") == "error" and str(e.get("message", "")).startswith("Reconnecting")]
        assert len(notices) == reconnects, context
        events = [e for e in events if e not in notices]
        assert self.run.returncode == 0, context
        messages = [e["item"].get("text", "") for e in events
                    if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
        assert any(f"Hello from {key}" in m for m in messages), context
        assert not [e for e in events if e.get("type") in ("error", "turn.failed")], context
        assert not [e for e in events if e.get("type") == "item.completed" and e["item"].get("type") == "error"], context
        assert events, context
        assert events[-1].get("type") == "turn.completed", context

    def assert_loopback_only(self) -> None:
        """Every upstream connection mitmdump opened went to 127.0.0.1."""
        connects = [(r["host"], r["port"]) for r in self.records if r["kind"] == "server_connect"]
        assert connects, connects
        elsewhere = [(host, port) for host, port in connects if host != "127.0.0.1"]
        assert not elsewhere, elsewhere


# The HTTP path (SSE) as Codex takes it when the proxy answers its upgrade 426.
DOWNGRADE = ["--set", "failover_websocket=downgrade"]


def run_codex(tmp_path: Path, codex_bin: Path, creds: list, *, extra: list[str] = (), prepare=None,
              output: tuple[str, ...] = ("--json",), pool_file=None, auth_json: dict | None = None,
              codex_args: tuple[str, ...] = (), client_key: str = CLIENT_KEY, shell: list[str] | None = None,
              proxy_class=ProxyProcess, sessions: int = 1, fake_args: tuple[str, ...] = (), **policy) -> CodexRun:
    """Start the fake and mitmdump (pool `creds`), run `codex exec "say hi"` with CLIENT_KEY, stop both.
    `prepare(fake)` runs before Codex starts (e.g. to queue scenarios). `pool_file(fake, tmp_path)` gives
    (pool text, env) instead of API-key `creds`; with `auth_json`, Codex is logged in with that
    auth.json (ChatGPT mode) instead of CLIENT_KEY (`client_key`: another key). With `shell` (e.g.
    `zsh -l -c`), Codex runs in that shell with no proxy variables or CA of its own: only what
    README.md's shell block, run in its HOME, gives every shell. `proxy_class`: e.g. a mitmweb.
    `sessions`: that many `codex exec` at once, each with a CODEX_HOME and work folder of its own.
    `fake_args`: more arguments for the fake upstream (e.g. `--stall 1`)."""
    fake = FakeUpstreamProcess(tmp_path, "--pace", "0.002", "--deltas", "5", *fake_args)
    proxy = None
    try:
        recorder = tmp_path / "recorder.py"
        recorder.write_text(RECORDER)
        record_path = tmp_path / "record.jsonl"
        pool, pool_env = pool_file(fake, tmp_path) if pool_file else pool_yaml(fake.base, creds, **policy)
        to_fake = rf"|^https?://(?!127\.0\.0\.1[:/])[^/]+|{fake.base}"
        # connection_strategy=lazy (the addon sets it too): a CONNECT never makes mitmdump resolve or
        # dial the named host itself, even if the addon failed to load. failover_intercept=all: Codex
        # also calls github.com and telemetry hosts, which the default (models) would tunnel out of
        # the machine; intercepted, map_remote keeps them on the fake.
        proxy = proxy_class(tmp_path, pool, {**pool_env, "CODEX_TEST_RECORD": str(record_path)},
                             extra=["--set", "connection_strategy=lazy", "--set", f"map_remote={to_fake}",
                                    "--set", "failover_intercept=all",
                                    "-s", str(recorder), *extra])
        ca = proxy.confdir / "mitmproxy-ca-cert.pem"
        assert ca.exists(), "mitmdump did not write its CA certificate"
        deadline = time.monotonic() + 5
        while "codex-failover: pool" not in proxy.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "codex-failover: pool" in proxy.log(), f"the addon did not load its pool file:\n{proxy.log()}"
        if prepare is not None:
            prepare(fake)

        home, codex_home, work = tmp_path / "home", tmp_path / "codex-home", tmp_path / "work"
        for d in (home, codex_home, work):
            d.mkdir()
        if auth_json is not None:
            (codex_home / "auth.json").write_text(json.dumps(auth_json))
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        env = {  # clean: none of the developer's keys, proxies or ~/.codex leak in
            "PATH": f"{Path(shutil.which('node')).parent}:/usr/bin:/bin",
            "HOME": str(home), "CODEX_HOME": str(codex_home), "LANG": "C.UTF-8",
            "CODEX_API_KEY": client_key, "CODEX_CA_CERTIFICATE": str(ca),
            "HTTPS_PROXY": proxy_url, "https_proxy": proxy_url, "HTTP_PROXY": proxy_url, "http_proxy": proxy_url,
            "ALL_PROXY": proxy_url, "all_proxy": proxy_url, "NO_PROXY": "", "no_proxy": "",
        }
        if auth_json is not None:
            del env["CODEX_API_KEY"]
        cmd = [str(codex_bin), "exec", *codex_args, *output, "--skip-git-repo-check", "--sandbox", "read-only",
               "--cd", str(work), "say hi"]
        if shell is not None:
            from test_readme_block import readme_block
            block = readme_block().replace("127.0.0.1:8080", f"127.0.0.1:{proxy.port}")
            subprocess.run(["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", "bash", "-c", block], check=True,
                           timeout=20, stdin=subprocess.DEVNULL)
            (home / ".mitmproxy").symlink_to(proxy.confdir)  # where the block says mitmproxy's CA is
            env = {k: env[k] for k in ("PATH", "HOME", "CODEX_HOME", "LANG", "CODEX_API_KEY") if k in env}
            cmd = [*shell, 'exec "$@"', "codex", *cmd]
        started, session_start = time.monotonic(), len(proxy.log())
        try:
            if sessions == 1:
                runs = [_run_bounded(cmd, CODEX_TIMEOUT, env=env, cwd=work)]
            else:
                runs = _run_many(cmd, sessions, tmp_path, env, codex_home, work, auth_json)
            run = runs[0]
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"codex exec did not finish within {CODEX_TIMEOUT:.0f}s (killed)\n--- codex stdout ---\n{exc.output}"
                        f"\n--- codex stderr ---\n{(exc.stderr or '')[-3000:]}\n--- mitmdump log ---\n{proxy.log()[-6000:]}")
        took = time.monotonic() - started
        time.sleep(0.2)  # the proxy's last log lines (socket ends)
        return CodexRun(run, took, _records(record_path), fake, proxy.log(), session_start, runs)
    finally:
        if proxy is not None:
            proxy.stop()
        fake.stop()


def test_real_codex_turn_completes_with_the_spare_when_its_own_key_is_overloaded(tmp_path, codex_bin, capsys,
                                                                               record_property):
    codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)], extra=DOWNGRADE)
    record_property("codex_exec_seconds", round(codex.took, 2))
    asked, records, context = codex.asked, codex.records, codex.context
    with capsys.disabled():
        print(f"\n[codex-cli] {codex_bin.parent.parent.parent.name}: codex exec took {codex.took:.2f}s, exit "
              f"{codex.run.returncode}; {len(asked)} requests: " + ", ".join(f"{r['method']} {r['url'].split('?')[0]}" for r in asked))
    codex.assert_completed_with(SPARE_KEY)

    # The fake: the client's overloaded attempt first, then the spare; one POST from Codex in all.
    served = [(r["method"], r["path"], r["credential"], r["scenario"]) for r in codex.fake.model_requests()]
    assert served == [("POST", "/v1/responses", CLIENT_KEY, "overload"),
                      ("POST", "/v1/responses", SPARE_KEY, "good")], context
    posts = [r for r in asked if r["method"] == "POST" and r["url"].split("?")[0].endswith("/responses")]
    assert [r["url"] for r in posts] == ["https://api.openai.com/v1/responses"], context

    # The addon: failover on the overload, commit on the spare; no secret in its log.
    log = codex.proxy_log
    assert "credential=client" in log, context
    assert "verdict=failover reason=overloaded" in log, context
    assert "credential=spare" in log, context
    assert "verdict=commit" in log, context
    assert "sk-test-" not in log, context

    # WebSocket first: the upgrade was answered 426 by the proxy (it never reached the upstream),
    # and Codex moved to HTTP POST + SSE at once: a single upgrade, before the POST.
    upgrades = [r for r in asked if r["upgrade"].lower() == "websocket"]
    assert [r["url"] for r in upgrades] == ["https://api.openai.com/v1/responses"], context
    answers = [r for r in records if r["kind"] == "response" and not r["replay"] and r["method"] == "GET"
               and r["url"] == "https://api.openai.com/v1/responses"]
    assert [r["status"] for r in answers] == [426], context
    assert upgrades[0]["t"] < posts[0]["t"], context
    assert not [r for r in codex.fake.requests() if r.get("method") == "GET" and r.get("path", "").endswith("/responses")]
    with capsys.disabled():
        print(f"[codex-cli] WebSocket upgrade -> 426, HTTP POST ({posts[0]['http_version']}) "
              f"{(posts[0]['t'] - upgrades[0]['t']) * 1000:.0f} ms later")
    codex.assert_loopback_only()


# -- the log: a few lines per model request ----------------------------------------------------------
# The default log is the addon's lines (one per attempt or turn, one per decision), warnings and
# errors. A session of several tool calls with one failover stays within LINES_PER_MODEL_REQUEST:
# before the quiet log (mitmproxy's connection lines, the flow echo) it was about 24.

LINES_PER_MODEL_REQUEST = 3
HEALTHY_KEY = "sk-test-client-ok"
TOOL_CALLS = 3


def _tool_session(fake, websocket: bool = False) -> None:
    """The client's first request is overloaded; then, whichever credential serves, TOOL_CALLS tool
    calls (each answered by a follow-up request of Codex) before the final answer."""
    if websocket:  # the socket's warm-up turn takes the first forced scenario
        fake.overload_next(HEALTHY_KEY, 1, "warmup")
    fake.overload_next(HEALTHY_KEY, 1, "overload")
    fake.overload_next(HEALTHY_KEY, TOOL_CALLS, "toolcall-again")
    fake.overload_next(SPARE_KEY, TOOL_CALLS, "toolcall-again")


def _lines_per_model_request(codex: CodexRun) -> tuple[float, int, list[str]]:
    posts = [r for r in codex.asked if r["method"] == "POST" and r["url"].split("?")[0].endswith("/responses")]
    lines = [line for line in codex.session_log if line.strip()]
    assert posts, codex.context
    return len(lines) / len(posts), len(posts), lines


@pytest.mark.parametrize("websocket", ["downgrade", "gate"])
def test_real_codex_session_logs_a_few_lines_per_model_request(tmp_path, codex_bin, capsys, websocket):
    if websocket == "gate":  # the gate dials its own sockets: both credentials pooled, on the fake
        codex = run_codex(tmp_path, codex_bin, [("primary", HEALTHY_KEY), ("spare", SPARE_KEY)],
                          prepare=lambda fake: _tool_session(fake, websocket=True), use_client_credential=False)
    else:
        codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)], prepare=_tool_session, client_key=HEALTHY_KEY,
                          extra=DOWNGRADE)
    assert codex.run.returncode == 0, codex.context
    assert [e for e in codex.events if e.get("type") == "turn.completed"], codex.context
    if websocket == "gate":  # on the socket: count turns (the fake's ws_turn records), warm-ups left out
        turns = [r for r in codex.fake.requests() if r.get("event") == "ws_turn" and r.get("generate") is not False]
        requests = len(turns)
        lines = [line for line in codex.session_log if line.strip()]
    else:
        per, requests, lines = _lines_per_model_request(codex)
    assert requests > TOOL_CALLS, codex.context  # the tool calls' follow-ups went through the proxy
    per = len(lines) / requests
    with capsys.disabled():
        print(f"\n[codex-cli] websocket={websocket}: {len(lines)} log lines for {requests} model requests "
              f"({per:.2f} per request):\n  " + "\n  ".join(lines))
    assert per <= LINES_PER_MODEL_REQUEST, "\n".join(lines)
    for chatter in ("client connect", "server connect", "WebSocket text message", "stream reset by client",
                    "cannot move", "<< 200"):
        assert chatter not in "\n".join(lines), "\n".join(lines)
    assert "sk-test-" not in codex.proxy_log


SESSIONS = 3
SESSION = re.compile(r" session=([0-9a-f]{4})$")


def test_three_concurrent_codex_sessions_on_the_gate_log_a_few_lines_per_model_request_each_named(tmp_path, codex_bin, capsys):
    """A day of three Codex sessions at once on the default transport (the gated WebSocket): each one's warm-up,
    a tool call and its follow-up; the first turn that reaches `primary` is overloaded and moves to the
    spare. At most LINES_PER_MODEL_REQUEST lines per model request; the warm-ups are not turns; every
    request's line names its session (three tags)."""
    codex = run_codex(tmp_path, codex_bin, [("primary", "sk-test-primary-toolcall"), ("spare", "sk-test-spare-toolcall")],
                      prepare=lambda fake: fake.overload_next("sk-test-primary-toolcall", 1, "overload"),
                      use_client_credential=False, sessions=SESSIONS)
    assert all(r.returncode == 0 for r in codex.runs), codex.context + "".join(r.stderr[-2000:] for r in codex.runs)
    for run in codex.runs:
        assert [e for e in _events(run.stdout) if e.get("type") == "turn.completed"], run.stdout[-2000:]
    turns = [r for r in codex.fake.requests() if r.get("event") == "ws_turn"]
    served = [r for r in turns if r.get("scenario") not in ("overload", "warmup")]  # one per model request
    assert len(served) >= 2 * SESSIONS and any(r["scenario"] == "overload" for r in turns), turns
    lines = [line for line in codex.session_log if line.strip()]
    per = len(lines) / len(served)
    with capsys.disabled():
        print(f"\n[codex-cli] {SESSIONS} sessions on the gate: {len(lines)} log lines for {len(served)} model requests "
              f"({per:.2f} per request):\n  " + "\n  ".join(lines))
    assert per <= LINES_PER_MODEL_REQUEST, "\n".join(lines)
    turn_lines = [line for line in lines if " turn " in line and "credential=" in line]
    assert len([line for line in turn_lines if "verdict=commit" in line]) == len(served), "\n".join(lines)
    tags = {m.group(1) for line in lines if (m := SESSION.search(line))}
    assert len(tags) == SESSIONS and all(SESSION.search(line) for line in turn_lines), "\n".join(lines)
    for chatter in ("Client TLS handshake failed", "trust the proxy", "socket on"):
        assert chatter not in "\n".join(lines), "\n".join(lines)


@pytest.mark.parametrize("shell", [["zsh", "-l", "-c"], ["bash", "-l", "-c"]], ids=["zsh -l", "bash -l"])
def test_real_codex_on_the_readme_variables_alone(tmp_path, codex_bin, shell):
    """README.md's block is all Codex gets (the proxy variables and CODEX_CA_CERTIFICATE): it works."""
    if not shutil.which(shell[0]):
        pytest.skip(f"{shell[0]} is not installed")
    codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)], shell=shell)
    codex.assert_completed_with(SPARE_KEY)
    codex.assert_loopback_only()


# -- mitmweb: no false alarm, no credential -----------------------------------------------------------

class _Mitmweb(MitmwebProcess):
    """mitmweb whose flows (its API's view, as the browser gets it) are read just before it stops."""

    flows: list = []
    shot: Path | None = None  # the flow list in headless Chromium, as a user sees it (None without one)

    def stop(self) -> None:
        time.sleep(0.5)  # the last hooks
        type(self).flows = self.api("/flows")
        type(self).shot = self._screenshot()
        super().stop()

    def _screenshot(self) -> Path | None:
        chromium = os.environ.get("CODEX_FAILOVER_CHROMIUM", "/usr/bin/chromium")
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            return None
        if not os.path.exists(chromium):
            return None
        shot = self.log_path.parent / "mitmweb-real-codex.png"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, timeout=15_000)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 520})
                page.goto(self.url, timeout=15_000)
                page.locator("tbody tr.has-request").first.wait_for(timeout=15_000)
                page.screenshot(path=str(shot))
            finally:
                browser.close()
        return shot


def test_real_codex_in_mitmweb_shows_the_winner_without_error_and_no_credential(tmp_path, codex_bin):
    """The spare's upstream writes its JSON with spaces and keeps the stream open after its last
    event, so Codex's reset at response.completed cancels the winner: it still shows no error. Every
    flow to a model host (127.0.0.1 here: the pool's base_url) is free of the key once finished."""
    codex = run_codex(tmp_path, codex_bin, [("spare", "sk-test-spare-spaced")], proxy_class=_Mitmweb, extra=DOWNGRADE)
    codex.assert_completed_with("sk-test-spare-spaced")
    flows, context = _Mitmweb.flows, codex.context
    winner = next(f for f in flows if f.get("marked") == "✅")
    assert winner.get("error") is None, (winner.get("error"), context)
    assert next(f for f in flows if f.get("marked") == "❌")["error"]["msg"] == "codex-failover: rejected: overloaded"
    model_flows = [f for f in flows if f["request"]["host"] in ("127.0.0.1", "api.openai.com", "chatgpt.com")]
    assert len(model_flows) >= 5, [f["request"]["path"] for f in flows]  # models, the upgrade, the POST, its attempts
    assert "sk-test-" not in json.dumps(model_flows), context
    if _Mitmweb.shot is not None:  # what a user sees: the ✅ row without ⚠ (docs/mitmweb.md)
        assert _Mitmweb.shot.stat().st_size > 10_000
        print(f"\n[codex-cli] mitmweb with the real Codex: {_Mitmweb.shot}")


# -- failover_websocket: gate, the default ----------------------------------------------------------
# Codex keeps its WebSocket (the proxy on its defaults). Most cases pool both credentials with the fake
# as base_url (use_client_credential: false). The client's own credential works too: each upstream
# socket is an attempt on mitmproxy's layers (ws/layer_socket.py), so the harness's map_remote sends it
# to the fake as it sends an HTTP attempt.

PRIMARY_KEY = "sk-test-primary-ok"


def _ws_turns(fake) -> list[tuple]:
    return [(r["credential"], r["scenario"], r["socket"], r["previous_response_id"] is not None)
            for r in fake.requests() if r.get("event") == "ws_turn"]


@pytest.mark.parametrize("primary", ["sk-test-overload-1", "sk-test-overload-503"], ids=["in-stream", "synchronous-503"])
def test_real_codex_over_the_gated_websocket_moves_an_overloaded_first_turn_to_the_spare(tmp_path, codex_bin, capsys,
                                                                                        primary):
    codex = run_codex(tmp_path, codex_bin, [("primary", primary), ("spare", SPARE_KEY)], use_client_credential=False)
    context = codex.context
    codex.assert_completed_with(SPARE_KEY)
    # Codex stayed on the WebSocket: no POST to /responses, no 426.
    assert not [r for r in codex.asked if r["method"] == "POST" and r["url"].split("?")[0].endswith("/responses")], context
    assert not [r for r in codex.records if r["kind"] == "response" and r.get("status") == 426], context
    turns = _ws_turns(codex.fake)
    if primary.endswith("503"):  # the primary's upgrade answered 503: the socket opened on the spare at once
        assert [r["credential"] for r in codex.fake.requests() if r.get("websocket")] == [primary, SPARE_KEY], context
        assert turns[:2] == [(SPARE_KEY, "warmup", 2, False), (SPARE_KEY, "good", 2, True)], context
        assert "upgrade failed (overloaded HTTP 503)" in codex.proxy_log, context
    else:  # the warm-up on the primary, the real turn overloaded there, then moved (full request) to the spare
        assert turns[:3] == [(primary, "warmup", 1, False), (primary, "overload", 1, True),
                             (SPARE_KEY, "good", 2, False)], context
        assert "moved to spare" in codex.proxy_log, context
    assert "sk-test-" not in codex.proxy_log, context
    codex.assert_loopback_only()
    with capsys.disabled():
        print(f"\n[codex-cli] gated WebSocket, first turn moved: codex exec took {codex.took:.2f}s; turns {turns}")


def test_real_codex_over_the_gate_on_its_own_overloaded_key_completes_on_the_spare(tmp_path, codex_bin, capsys):
    """Codex's own credential first, on the socket map_remote sends to the fake (before: the gate
    dialled api.openai.com itself, could not resolve it and skipped the client's credential)."""
    codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)])
    context = codex.context
    codex.assert_completed_with(SPARE_KEY)
    assert not [r for r in codex.asked if r["method"] == "POST" and r["url"].split("?")[0].endswith("/responses")], context
    assert not [r for r in codex.records if r["kind"] == "response" and r.get("status") == 426], context
    turns = _ws_turns(codex.fake)
    assert [t[:2] for t in turns[:3]] == [(CLIENT_KEY, "warmup"), (CLIENT_KEY, "overload"), (SPARE_KEY, "good")], context
    assert "upgrade failed" not in codex.proxy_log, context
    assert "sk-test-" not in codex.proxy_log, context
    codex.assert_loopback_only()
    with capsys.disabled():
        print(f"\n[codex-cli] gated WebSocket on the client's own key: codex exec took {codex.took:.2f}s; turns {turns}")


@pytest.mark.parametrize("spare", ["sk-test-spare-overload", "sk-test-spare-usage-limit"])
def test_real_codex_over_the_gate_with_the_whole_pool_rejecting_ends_as_on_http(tmp_path, codex_bin, capsys, spare):
    """Every credential overloaded, or at its usage limit, on the gated WebSocket: Codex stops with the
    same clear message as over HTTP, within the same bound."""
    codex = run_codex(tmp_path, codex_bin, [("spare", spare)],
                      **({} if "overload" in spare else {"use_client_credential": False}))
    errors = _errors(codex)
    with capsys.disabled():
        print(f"\n[codex-cli] gate, whole pool {spare.split('-', 3)[-1]}: codex exec took {codex.took:.2f}s, "
              f"exit {codex.run.returncode}; errors: {errors}; turns {_ws_turns(codex.fake)}")
    assert codex.run.returncode != 0, codex.context
    expected = "at capacity" if "overload" in spare else "try again at"
    assert errors and expected in errors[-1].lower(), codex.context
    assert codex.took < 15.0, codex.context


def test_real_codex_reconnects_after_a_rejected_later_turn_and_completes_on_the_spare(tmp_path, codex_bin, capsys):
    def prepare(fake):  # on the primary's socket: the warm-up, a tool call, then the follow-up is overloaded
        for scenario in ("warmup", "toolcall", "overload"):
            fake.overload_next(PRIMARY_KEY, 1, scenario)

    codex = run_codex(tmp_path, codex_bin, [("primary", PRIMARY_KEY), ("spare", SPARE_KEY)],
                      prepare=prepare, use_client_credential=False)
    context = codex.context
    codex.assert_completed_with(SPARE_KEY)
    turns = _ws_turns(codex.fake)
    assert turns[:3] == [(PRIMARY_KEY, "warmup", 1, False), (PRIMARY_KEY, "toolcall", 1, True),
                         (PRIMARY_KEY, "overload", 1, True)], context
    # The client socket was closed with 1012; Codex reconnected, and the new socket went to the spare
    # (the primary cools) with the full request: no previous_response_id.
    assert "closing the client socket with 1012" in codex.proxy_log, context
    after = turns[3:]
    assert after, context
    assert all(cred == SPARE_KEY for cred, *_ in after), context
    assert not [t for t in after if t[1] == "previous_response_not_found"], context
    codex.assert_loopback_only()
    with capsys.disabled():
        shown = [e for e in codex.events if e.get("type") not in ("thread.started", "turn.started")]
        print(f"\n[codex-cli] gated WebSocket, later turn rejected: codex exec took {codex.took:.2f}s; turns {turns}; "
              f"codex --json events: {[e.get('type') + ':' + e.get('item', {}).get('type', '') for e in shown]}")


# -- ChatGPT login, a long session: a failover, then a compaction mid-turn ---------------------------


def _jwt(claims: dict) -> str:
    """An unsigned test JWT (Codex reads its claims; nothing verifies it here)."""
    import base64

    def part(obj):
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.c2ln"


def chatgpt_auth(account: str) -> dict:
    """A Codex auth.json for ChatGPT account `account`, valid for a day."""
    now = int(time.time())
    profile = {"chatgpt_account_id": account, "chatgpt_plan_type": "plus", "chatgpt_user_id": f"user-{account}",
               "user_id": f"user-{account}"}
    claims = {"https://api.openai.com/auth": profile, "email": f"{account}@example.com", "iat": now, "exp": now + 86400}
    return {"auth_mode": "chatgpt", "OPENAI_API_KEY": None,
            "tokens": {"id_token": _jwt({**claims, "email_verified": True}), "access_token": _jwt(claims),
                       "refresh_token": "rt-test-not-used", "account_id": account},
            "last_refresh": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}


OWN_ACCOUNT = "own-usage-limit"  # the fake answers this account's model requests with HTTP 429 usage_limit_reached
WORK_ACCOUNT = "work-toolcall"  # a tool call first, then (once the tool's output comes back) the answer


def _work_pool(fake, tmp_path):
    path = tmp_path / "work-auth.json"
    path.write_text(json.dumps(chatgpt_auth(WORK_ACCOUNT)))
    return (f"credentials:\n  - name: work\n    auth_file: {path}\n    base_url: {fake.base}/backend-api/codex\n", {})


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_chatgpt_session_compacts_after_a_failover_and_completes_on_the_account_that_holds_it(
        tmp_path, codex_bin, capsys, websocket):
    """The own account is at its usage limit: the turn fails over to `work`, which calls a tool;
    Codex then compacts mid-turn (remote_compaction_v2 on 0.171), and the request after the
    compaction carries work's compaction item: it must go to work (the fake refuses another
    account's encrypted content with 400), and the session ends with the answer, exit 0."""
    codex = run_codex(tmp_path, codex_bin, [], pool_file=_work_pool, auth_json=chatgpt_auth(OWN_ACCOUNT),
                      codex_args=("-c", "model_auto_compact_token_limit=100"),
                      extra=["--set", f"failover_websocket={websocket}"])
    context = codex.context
    requests = codex.fake.model_requests() if websocket == "downgrade" else [  # on the socket: its turns
        r for r in codex.fake.requests() if r.get("event") == "ws_turn" and r.get("generate") is not False]
    served = [(r["credential"], r["scenario"], r.get("compaction_trigger"), r.get("compaction"), r.get("foreign_encrypted"))
              for r in requests]
    with capsys.disabled():
        print(f"\n[codex-cli] chatgpt session ({websocket}): exit {codex.run.returncode} in {codex.took:.1f}s; model requests: {served}")
    assert codex.run.returncode == 0, context
    messages = [e["item"].get("text", "") for e in codex.events
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
    assert any(f"Hello from {WORK_ACCOUNT}" in m for m in messages), context
    assert not [e for e in codex.events if e.get("type") in ("error", "turn.failed")], context
    triggers = [i for i, r in enumerate(served) if r[2]]
    assert triggers, f"Codex did not compact: {served}" + context
    after = served[triggers[0]:]
    assert all(cred == WORK_ACCOUNT for cred, *_ in after), served
    assert any(r[3] for r in after[1:]), f"no request carried the compaction item: {served}"
    assert not any(r[4] for r in served), f"another account's encrypted content was sent: {served}"
    if websocket == "downgrade":  # each POST is placed anew: by the compaction item's maker
        assert "made by credential work" in codex.proxy_log, context
    else:  # the socket stays on work's credential, the compaction turn and the one after it too
        assert "verdict=commit" in codex.proxy_log and "moved" not in codex.proxy_log, context
    codex.assert_loopback_only()


# -- nothing can serve: what the user reads, and how soon -------------------------------------------

def _errors(codex: CodexRun) -> list[str]:
    return [e.get("message", "") for e in codex.events if e.get("type") == "error"]


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_with_the_whole_pool_overloaded_stops_with_a_clear_message_within_the_bound(tmp_path, codex_bin,
                                                                                               capsys, websocket):
    """Every credential overloaded (resting 15 s or more, the first of an overload streak): the answer
    has no Retry-After (nothing is back within max_retry_after), so Codex stops after its quick re-sends
    with "Selected model is at capacity" in seconds, not minutes (docs/decisions.md#answers-that-tell-the-time).
    On the gate, the turn's socket closes with 1012 once; Codex's reconnect is answered 426 (its last
    socket closed exhausted: core/turn_machine.Reconnects), and the HTTP path answers the re-send
    (before: a 1012 at each of Codex's five reconnects)."""
    codex = run_codex(tmp_path, codex_bin, [("spare", "sk-test-spare-overload")],
                      extra=["--set", f"failover_websocket={websocket}"])
    errors = _errors(codex)
    with capsys.disabled():
        print(f"\n[codex-cli] whole pool overloaded ({websocket}): codex exec took {codex.took:.2f}s, exit "
              f"{codex.run.returncode}, {len(codex.fake.model_requests())} model requests upstream, "
              f"{codex.proxy_log.count('closing the client socket with 1012')} close(s) 1012; errors: {errors}")
    assert codex.run.returncode != 0, codex.context
    assert errors and "at capacity" in errors[-1], codex.context
    assert codex.took < 15.0, codex.context
    if websocket == "gate":
        assert codex.proxy_log.count("closing the client socket with 1012") == 1, codex.context
        assert "its last socket closed because nothing could serve its turn" in codex.proxy_log, codex.context


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_is_served_after_a_short_burst_on_its_own_key_and_the_only_spare(tmp_path, codex_bin, capsys,
                                                                                    websocket):
    """The client's own key and the pool's only spare each overloaded twice, then fine (a short burst on
    every account): both rest, and the share held out for overload counts the pool's only, so nothing came
    back early; each of Codex's re-sends now probes the least recently failed once, and one is served
    (before: every re-send was answered `503 (not dialled)` and Codex exited 1 in 3.7 s,
    docs/pool-file.md#overload-cooldowns)."""
    own = "sk-test-client-good"

    def prepare(fake):
        fake.overload_next(own, 2)
        fake.overload_next(SPARE_KEY, 2)

    codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)], client_key=own, prepare=prepare,
                      extra=["--set", f"failover_websocket={websocket}"])
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} short burst on own + the only spare ({websocket}): exit "
              f"{codex.run.returncode} in {codex.took:.2f}s; errors {_errors(codex)}; "
              f"{codex.proxy_log.count('no credential ready; probing')} probe(s)")
    assert codex.run.returncode == 0, codex.context
    assert "no credential ready; probing" in codex.proxy_log, codex.context
    assert codex.took < 15.0, codex.context
    codex.assert_loopback_only()


def test_real_codex_with_the_whole_pool_at_its_usage_limit_prints_when_to_try_again(tmp_path, codex_bin, capsys):
    codex = run_codex(tmp_path, codex_bin, [("spare", "sk-test-spare-usage-limit")],
                      use_client_credential=False, extra=DOWNGRADE)
    errors = _errors(codex)
    with capsys.disabled():
        print(f"\n[codex-cli] whole pool at its usage limit: codex exec took {codex.took:.2f}s; errors: {errors}")
    assert codex.run.returncode != 0, codex.context
    assert errors and "try again at" in errors[-1].lower(), codex.context


# -- an overload that could still be served never reaches Codex (one rule for both transports) ------

ONCE_KEY = "sk-test-client-overload-once"  # the client's own key: its first model request is overloaded


def _served_once(codex: CodexRun, capsys, what: str, key: str) -> None:
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} {what}: codex exec took {codex.took:.2f}s, exit {codex.run.returncode}; "
              f"errors {_errors(codex)}; agent messages "
              f"{[e['item'].get('text', '') for e in codex.events if e.get('item', {}).get('type') == 'agent_message']}")
    codex.assert_completed_with(key)
    codex.assert_loopback_only()


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_without_a_pool_is_served_by_its_own_overloaded_key_after_the_backoff(tmp_path, codex_bin, capsys,
                                                                                        websocket):
    """No pool, the own account overloaded once: the same backoff (0.5 s) on the gated WebSocket as on
    HTTP, and the answer; never the overload (before: the gate delivered it, Codex exited 1)."""
    codex = run_codex(tmp_path, codex_bin, [], client_key=ONCE_KEY, extra=["--set", f"failover_websocket={websocket}"])
    _served_once(codex, capsys, f"no pool, own key overloaded once ({websocket})", ONCE_KEY)
    assert codex.took < 10.0, codex.context
    if websocket == "gate":  # still on the WebSocket: the turn retried on a new socket of the same key
        assert not [r for r in codex.asked if r["method"] == "POST" and r["url"].split("?")[0].endswith("/responses")], \
            codex.context
        assert [t[:2] for t in _ws_turns(codex.fake)][-2:] == [(ONCE_KEY, "overload"), (ONCE_KEY, "good")], codex.context


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_with_every_account_overloaded_at_once_is_served_when_one_is_back(tmp_path, codex_bin, capsys,
                                                                                     websocket):
    """A burst: the own account and three spares each overloaded once at the same moment, then fine.
    Exhausted on the gate, the client socket closes with 1012 (a close Codex retries), as HTTP's 503 is
    re-sent; the re-sent request is served (before: the gate delivered the overload, Codex exited 1)."""
    spares = [(f"s{i}", f"sk-test-s{i}-overload-once") for i in (1, 2, 3)]
    codex = run_codex(tmp_path, codex_bin, spares, client_key=ONCE_KEY, extra=["--set", f"failover_websocket={websocket}"])
    served = [e["item"].get("text", "") for e in codex.events if e.get("item", {}).get("type") == "agent_message"]
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} burst on every account ({websocket}): codex exec took {codex.took:.2f}s, "
              f"exit {codex.run.returncode}; errors {_errors(codex)}; agent messages {served}")
    assert codex.run.returncode == 0, codex.context
    assert served and "Hello from sk-test-" in served[-1], codex.context
    assert not [e for e in codex.events if e.get("type") in ("error", "turn.failed")], codex.context
    assert codex.took < 15.0, codex.context
    if websocket == "gate":
        assert "closing the client socket with 1012" in codex.proxy_log, codex.context
    codex.assert_loopback_only()


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_gets_one_whole_answer_when_its_turn_is_overloaded_after_a_few_deltas(tmp_path, codex_bin, capsys,
                                                                                         websocket):
    """An overload after output began: on the gated WebSocket the turn ends in a close Codex retries
    (1012); over HTTP (`downgrade`) the stream ends after the output's whole events, without the
    rejection and without response.completed, which Codex re-sends. Either way the credential cools and
    Codex's re-send is answered by the spare: exit 0, one whole answer, the first attempt's delta not
    repeated in it (before: the overload was delivered, exit 1)."""
    def prepare(fake):
        for scenario in (["warmup", "delta-overload"] if websocket == "gate" else ["delta-overload"]):
            fake.overload_next(PRIMARY_KEY, 1, scenario)

    codex = run_codex(tmp_path, codex_bin, [("primary", PRIMARY_KEY), ("spare", SPARE_KEY)], prepare=prepare,
                      use_client_credential=False, extra=["--set", f"failover_websocket={websocket}"])
    messages = [e["item"].get("text", "") for e in codex.events
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} overload after a delta ({websocket}): codex exec took {codex.took:.2f}s, "
              f"exit {codex.run.returncode}; errors {_errors(codex)}; agent messages {messages}")
    codex.assert_completed_with(SPARE_KEY, reconnects=0 if websocket == "gate" else 1)  # (Codex says it re-sends)
    assert len(messages) == 1 and not messages[0].startswith("Hi"), codex.context
    assert ("after the turn's output began" if websocket == "gate" else "rejected after its output began") \
        in codex.proxy_log, codex.context
    codex.assert_loopback_only()


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_without_a_pool_overloaded_after_a_delta_is_served_by_its_own_key(tmp_path, codex_bin, capsys,
                                                                                     websocket):
    """No pool, the own account overloaded once after the output began: the stream (or turn) ends so
    Codex re-sends, and the re-send is served by the same key after its backoff: exit 0, one answer."""
    key = "sk-test-client-good"

    def prepare(fake):
        for scenario in (["warmup", "delta-overload"] if websocket == "gate" else ["delta-overload"]):
            fake.overload_next(key, 1, scenario)

    codex = run_codex(tmp_path, codex_bin, [], client_key=key, prepare=prepare,
                      extra=["--set", f"failover_websocket={websocket}"])
    messages = [e["item"].get("text", "") for e in codex.events
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} no pool, overload after a delta ({websocket}): codex exec took "
              f"{codex.took:.2f}s, exit {codex.run.returncode}; errors {_errors(codex)}; agent messages {messages}")
    codex.assert_completed_with(key, reconnects=0 if websocket == "gate" else 1)
    assert len(messages) == 1 and not messages[0].startswith("Hi"), codex.context
    assert codex.took < 10.0, codex.context


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_session_pinned_to_a_spare_overloaded_once_is_served_within_seconds(tmp_path, codex_bin, capsys,
                                                                                     websocket):
    """The session's compaction item belongs to `work`, so the request after the compaction must stay
    there; work is overloaded once right then. It is retried on work after the backoff (on the gated
    socket: the same create on the same socket), and served within seconds (before, on the gate: the
    overload was delivered, and Codex's reconnects and HTTP re-sends were refused `503 (not dialled)`
    for work's whole rest)."""
    def prepare(fake):
        turns = ["toolcall", "toolcall", "overload"]
        for scenario in (["warmup", *turns] if websocket == "gate" else turns):
            fake.overload_next(WORK_ACCOUNT, 1, scenario)

    codex = run_codex(tmp_path, codex_bin, [], pool_file=_work_pool, auth_json=chatgpt_auth(OWN_ACCOUNT),
                      codex_args=("-c", "model_auto_compact_token_limit=100"), prepare=prepare,
                      extra=["--set", f"failover_websocket={websocket}"])
    requests = codex.fake.model_requests() if websocket == "downgrade" else [
        r for r in codex.fake.requests() if r.get("event") == "ws_turn" and r.get("generate") is not False]
    served = [(r["credential"], r["scenario"], r.get("compaction")) for r in requests]
    messages = [e["item"].get("text", "") for e in codex.events
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
    with capsys.disabled():
        print(f"\n[codex-cli] {CODEX_VERSION} pinned session, work overloaded once ({websocket}): exit "
              f"{codex.run.returncode} in {codex.took:.2f}s; errors {_errors(codex)}; messages {messages}; "
              f"model requests {served}")
    assert codex.run.returncode == 0, codex.context
    assert any(f"Hello from {WORK_ACCOUNT}" in m for m in messages), codex.context
    assert (WORK_ACCOUNT, "overload", 1) in served, f"work was not overloaded after the compaction: {served}"
    assert "not dialled" not in codex.proxy_log, codex.context
    assert codex.took < 10.0, codex.context
    codex.assert_loopback_only()


def test_real_codex_over_http_is_served_when_the_sse_carries_no_content_type(tmp_path, codex_bin, capsys):
    """The real backend's SSE may carry no Content-Type: the in-stream overload on the client's key is
    still held and moved, and Codex gets the spare's answer (before: the overload reached Codex)."""
    codex = run_codex(tmp_path, codex_bin, [("spare", "sk-test-spare-noctype-good")],
                      client_key="sk-test-client-noctype-overload", extra=DOWNGRADE)
    _served_once(codex, capsys, "SSE without Content-Type (downgrade)", "sk-test-spare-noctype-good")


@pytest.mark.parametrize("websocket", ["gate", "downgrade"])
def test_real_codex_is_served_when_its_rejection_comes_late(tmp_path, codex_bin, capsys, websocket):
    """Scaled (bootstrap_timeout 0.3 s for 30 s, first_event_timeout 0.8 s for 60 s): over HTTP an
    overload about 1 s after response.created with only keepalives before it, on the gated socket an
    upstream silent past first_event_timeout; either moves to the spare (before: committed at
    bootstrap_timeout, the late overload reached Codex, and the silent turn waited on its upstream)."""
    client = "sk-test-client-late-overload" if websocket == "downgrade" else "sk-test-client-stall"
    codex = run_codex(tmp_path, codex_bin, [("spare", SPARE_KEY)], client_key=client, fake_args=("--stall", "3"),
                      extra=["--set", f"failover_websocket={websocket}"], bootstrap_timeout="0.3s",
                      first_event_timeout="0.8s", max_hold="20s")
    _served_once(codex, capsys, f"late rejection ({websocket})", SPARE_KEY)
    with capsys.disabled():
        print("\n".join(line for line in codex.session_log if "verdict=" in line or "moved" in line or "1012" in line))
    assert codex.took < 10.0, codex.context
