"""scripts/service: the systemd unit and the launchd agent it writes, checked by systemd's own parsers
where this machine has them, and install/uninstall/status run against fake systemctl/launchctl/curl on
PATH with HOME and XDG_CONFIG_HOME in tmp_path, so the real user's service manager is never touched."""

import os
import plistlib
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "scripts" / "service"
TIMEOUT = 20
UNIT = "codex-failover.service"
LABEL = "dev.codex-failover.proxy"

# A path with a space and a '%' (systemd specifier), and other arguments that need quoting.
POOL = "/home/me/my pools/pool 100%.yaml"
ARGS = ["--set", f"failover_config={POOL}", "-p", "9090"]
AWKWARD = ["a$b", "back\\slash", 'q"uote', "it's", ";", ""]


def service(*args, env=None, script=SERVICE, check=True):
    proc = subprocess.run(["bash", str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=Path(script).parents[1], stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def unit_lines(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


@pytest.fixture
def clone(tmp_path):
    """A stand-in clone at a path with a space and a '%': the real scripts/service, a stub scripts/run,
    and a scripts/setup that only logs that it ran."""
    root = tmp_path / "my clone 100%"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SERVICE, root / "scripts" / "service")
    executable(root / "scripts" / "run", "#!/bin/sh\nexit 0\n")
    executable(root / "scripts" / "setup", '#!/bin/sh\necho "setup $*" >> "$FAKE_LOG"\n')
    return root


@pytest.fixture
def fake_env(tmp_path):
    """PATH with fake systemctl, loginctl, launchctl and curl that log their arguments to $FAKE_LOG."""
    bin_dir = tmp_path / "fakebin"
    log = tmp_path / "calls.log"
    log.touch()
    executable(bin_dir / "systemctl", """#!/bin/sh
if [ "$*" = "--user show-environment" ] && [ -n "${FAKE_NO_BUS:-}" ]; then
    echo "Failed to connect to bus: No medium found" >&2
    exit 1
fi
echo "systemctl $*" >> "$FAKE_LOG"
case "$*" in *" status "*) echo "fake status output"; exit 3 ;; esac
exit 0
""")
    executable(bin_dir / "loginctl", '#!/bin/sh\necho "loginctl $*" >> "$FAKE_LOG"\necho no\n')
    executable(bin_dir / "curl", '#!/bin/sh\necho "curl $*" >> "$FAKE_LOG"\nprintf 000\nexit 7\n')
    # launchctl: "print" succeeds while the agent is loaded (between bootstrap and bootout).
    executable(bin_dir / "launchctl", """#!/bin/sh
echo "launchctl $*" >> "$FAKE_LOG"
case "$1" in
    print) [ -f "$FAKE_LOG.loaded" ] || exit 113; echo "fake print output" ;;
    bootstrap) touch "$FAKE_LOG.loaded" ;;
    bootout) rm -f "$FAKE_LOG.loaded" ;;
esac
exit 0
""")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "USER": "tester",
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "FAKE_LOG": str(log), "LC_ALL": "C"}
    return env


def calls(env) -> list[str]:
    return Path(env["FAKE_LOG"]).read_text().splitlines()


# -- the systemd unit -------------------------------------------------------------------------------

def test_unit_quotes_exec_start_for_systemd(clone):
    text = service("unit", "--systemd", "--", *ARGS, script=clone / "scripts" / "service").stdout
    lines = unit_lines(text)
    esc_root = str(clone).replace("%", "%%")
    assert lines["ExecStart"] == [
        f'"{esc_root}/scripts/run" --set "failover_config=/home/me/my pools/pool 100%%.yaml" -p 9090']
    assert lines["WorkingDirectory"] == [esc_root]
    assert lines["Restart"] == ["on-failure"]
    assert lines["RestartSec"] == ["2"]
    assert lines["Environment"] == ["PYTHONUNBUFFERED=1"]
    config = os.environ.get("XDG_CONFIG_HOME", "")
    config = config if config.startswith("/") else f"{Path.home()}/.config"
    assert lines["EnvironmentFile"] == [f"-{config}/codex-failover/env".replace("%", "%%")]
    assert lines["WantedBy"] == ["default.target"]
    assert lines["Description"] == ["codex-failover proxy for OpenAI Codex (mitmdump on 127.0.0.1:9090)"]
    assert f"# Written by {clone}/scripts/service install" in text
    assert text.splitlines()[0].startswith("# codex-failover:")
    lines = text.splitlines()
    again = lines[next(i for i, line in enumerate(lines) if "Reinstall with:" in line) + 1]
    assert shlex.split(again.lstrip("#")) == [str(clone / "scripts" / "service"), "install", "--", *ARGS]


def test_unit_escapes_dollars_backslashes_and_quotes(clone):
    text = service("unit", "--systemd", "--", *AWKWARD, script=clone / "scripts" / "service").stdout
    (exec_start,) = unit_lines(text)["ExecStart"]
    run = str(clone / "scripts" / "run").replace("%", "%%")
    assert exec_start == f'"{run}" a$$b "back\\\\slash" "q\\"uote" "it\'s" ";" ""'


def test_unit_of_this_clone_runs_its_scripts_run():
    text = service("unit", "--systemd").stdout
    lines = unit_lines(text)
    run, root = str(ROOT / "scripts" / "run").replace("%", "%%"), str(ROOT).replace("%", "%%")
    assert lines["ExecStart"] in ([run], [f'"{run}"'])
    assert lines["WorkingDirectory"] == [root]
    assert "# Proxy: 127.0.0.1:8080" in text.splitlines()


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify --user on the unit, in a private HOME/XDG_RUNTIME_DIR (no user manager)."""
    unit_dir = tmp_path / "verify" / "units"
    unit_dir.mkdir(parents=True)
    runtime = tmp_path / "verify" / "runtime"
    runtime.mkdir(mode=0o700)
    (unit_dir / UNIT).write_text(unit_text)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "verify"), "XDG_RUNTIME_DIR": str(runtime),
           "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    return subprocess.run(["systemd-analyze", "verify", "--user", str(unit_dir / UNIT)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL)


NEEDS_ANALYZE = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")


def complaints(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "codex-failover" in line or UNIT in line]


@NEEDS_ANALYZE
@pytest.mark.parametrize("where", ["this clone", "a clone at a path with a space and a %"])
def test_systemd_analyze_verifies_the_unit(where, clone, tmp_path):
    script = SERVICE if where == "this clone" else clone / "scripts" / "service"
    text = service("unit", "--systemd", "--", *ARGS, *AWKWARD, script=script).stdout
    proc = verify(text, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert complaints(proc) == [], proc.stdout + proc.stderr


@NEEDS_ANALYZE
def test_systemd_analyze_does_read_our_exec_start(clone, tmp_path):
    """The check above is not vacuous: verify unquotes the executable path (a space, a %) and looks at it."""
    (clone / "scripts" / "run").chmod(0o644)
    proc = verify(service("unit", "--systemd", script=clone / "scripts" / "service").stdout, tmp_path)
    assert proc.returncode != 0
    assert f"Command {clone}/scripts/run is not executable" in proc.stdout + proc.stderr


def systemd_binary():
    return next((p for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd") if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(not systemd_binary(), reason="no systemd binary to parse the unit with")
def test_systemd_parses_exec_start_back_into_the_same_arguments(clone):
    """`systemd --test --user` loads the unit with systemd's own parser and dumps each command line
    (shell-quoted; '$$' is kept until exec, where it becomes '$'). It refuses to run as root."""
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv is missing: systemd --test refuses root")
        nobody = pwd.getpwnam("nobody")
        prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
    base = Path(tempfile.mkdtemp(prefix="codex-failover-systemd-"))  # outside tmp_path: nobody reads it
    try:
        base.chmod(0o755)
        units, runtime = base / "units", base / "runtime"
        units.mkdir(mode=0o755)
        runtime.mkdir(mode=0o700)
        if prefix:
            os.chown(runtime, nobody.pw_uid, nobody.pw_gid)
        args = [*ARGS, *AWKWARD]
        text = service("unit", "--systemd", "--", *args, script=clone / "scripts" / "service").stdout
        (units / UNIT).write_text(text)
        (units / UNIT).chmod(0o644)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(runtime), "XDG_RUNTIME_DIR": str(runtime),
               "SYSTEMD_UNIT_PATH": f"{units}:", "SYSTEMD_LOG_COLOR": "0"}
        proc = subprocess.run([*prefix, systemd_binary(), "--test", "--user", f"--unit={UNIT}", "--no-pager"],
                              capture_output=True, text=True, timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if proc.returncode != 0:
        pytest.skip(f"systemd --test cannot run here: {proc.stderr.strip()[-300:]}")
    section = proc.stdout.split(f"-> Unit {UNIT}:", 1)
    assert len(section) == 2, "our unit is not in the dump"
    section = section[1].split("\n\t-> Unit ", 1)[0]
    command = [line.split("Command Line:", 1)[1] for line in section.splitlines() if "Command Line:" in line]
    if not command:
        pytest.skip("this systemd's dump shows no 'Command Line:'")
    # The dump quotes as a POSIX shell would read it (\$ inside double quotes, which shlex keeps): let sh read it.
    argv = subprocess.run(["sh", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "sh", command[0]],
                          capture_output=True, text=True, timeout=TIMEOUT, check=True).stdout.split("\0")[:-1]
    assert argv == [f"{clone}/scripts/run", *[a.replace("$", "$$") for a in args]]
    assert f"WorkingDirectory: {clone}" in section


# -- the launchd agent ------------------------------------------------------------------------------

def test_launchd_plist_parses_with_the_arguments_in_order(clone, fake_env):
    args = [*ARGS, "--set", "failover_rules=/x/a&b<c>.yaml", "it's \"quoted\""]
    text = service("unit", "--launchd", "--", *args, env=fake_env, script=clone / "scripts" / "service").stdout
    plist = plistlib.loads(text.encode())
    home = fake_env["HOME"]
    assert plist["Label"] == LABEL
    logs = f"{fake_env['HOME']}/Library/Logs/codex-failover"
    assert plist["ProgramArguments"] == [f"{clone}/scripts/service-run", f"{fake_env['XDG_CONFIG_HOME']}/codex-failover/env",
                                         f"{logs}/proxy.log", "10", f"{clone}/scripts/run", *args]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["WorkingDirectory"] == str(clone)
    assert plist["StandardOutPath"] == f"{home}/Library/Logs/codex-failover/proxy.err.log"  # service-run's own
    assert plist["StandardErrorPath"] == f"{home}/Library/Logs/codex-failover/proxy.err.log"
    assert plist["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"


def test_launchd_install_and_uninstall_with_a_fake_launchctl(clone, fake_env):
    script = clone / "scripts" / "service"
    plist = Path(fake_env["HOME"]) / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    target = f"gui/{os.getuid()}"
    service("install", "--launchd", "--", *ARGS, env=fake_env, script=script)
    assert plistlib.loads(plist.read_bytes())["ProgramArguments"][4:] == [f"{clone}/scripts/run", *ARGS]
    assert (Path(fake_env["HOME"]) / "Library" / "Logs" / "codex-failover").is_dir()
    assert calls(fake_env) == ["setup none", f"launchctl print {target}/{LABEL}", f"launchctl enable {target}/{LABEL}",
                               f"launchctl bootstrap {target} {plist}"]
    Path(fake_env["FAKE_LOG"]).write_text("")
    service("install", "--launchd", env=fake_env, script=script)  # again: the loaded agent is replaced
    assert calls(fake_env)[1:4] == [f"launchctl print {target}/{LABEL}", f"launchctl bootout {target}/{LABEL}",
                                    f"launchctl enable {target}/{LABEL}"]
    Path(fake_env["FAKE_LOG"]).write_text("")
    service("uninstall", "--launchd", env=fake_env, script=script)
    assert calls(fake_env) == [f"launchctl print {target}/{LABEL}", f"launchctl bootout {target}/{LABEL}"]
    assert not plist.exists()


# -- install / uninstall / status with a fake systemctl ---------------------------------------------

def test_install_writes_the_unit_and_enables_it_then_uninstall_removes_it(clone, fake_env):
    script = clone / "scripts" / "service"
    unit_path = Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT
    proc = service("install", "--systemd", "--", *ARGS, env=fake_env, script=script)
    assert unit_path.read_text() == service("unit", "--systemd", "--", *ARGS, env=fake_env, script=script).stdout
    assert stat.S_IMODE(unit_path.stat().st_mode) == 0o600  # private: nobody else reads its arguments
    assert [c for c in calls(fake_env) if not c.startswith("loginctl")] == [
        "systemctl --user show-environment", "setup none", "systemctl --user daemon-reload",
        f"systemctl --user enable --now {UNIT}"]
    assert "loginctl enable-linger" in proc.stdout  # the fake loginctl says Linger=no
    assert not (Path(fake_env["HOME"]) / ".config").exists()  # XDG_CONFIG_HOME was respected

    Path(fake_env["FAKE_LOG"]).write_text("")
    service("install", "--systemd", "--", "-p", "9191", env=fake_env, script=script)
    assert f"systemctl --user restart {UNIT}" in calls(fake_env)  # a changed unit restarts the proxy
    assert "-p 9191" in unit_path.read_text()

    Path(fake_env["FAKE_LOG"]).write_text("")
    service("uninstall", "--systemd", env=fake_env, script=script)
    assert calls(fake_env) == ["systemctl --user show-environment", f"systemctl --user disable --now {UNIT}",
                               "systemctl --user daemon-reload"]
    assert not unit_path.exists()
    assert "not installed" in service("uninstall", "--systemd", env=fake_env, script=script).stdout


def test_install_without_xdg_config_home_uses_dot_config(clone, fake_env):
    del fake_env["XDG_CONFIG_HOME"]
    service("install", "--systemd", env=fake_env, script=clone / "scripts" / "service")
    assert (Path(fake_env["HOME"]) / ".config" / "systemd" / "user" / UNIT).is_file()


def test_install_refuses_when_systemctl_user_has_no_bus(clone, fake_env):
    fake_env["FAKE_NO_BUS"] = "1"
    proc = service("install", "--systemd", env=fake_env, script=clone / "scripts" / "service", check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1
    assert "loginctl enable-linger tester" in proc.stderr, proc.stdout + proc.stderr
    assert "No medium found" in proc.stderr
    assert calls(fake_env) == []  # not even scripts/setup
    assert not Path(fake_env["XDG_CONFIG_HOME"]).exists()


def test_dry_run_prints_the_plan_and_changes_nothing(clone, fake_env):
    proc = service("install", "--systemd", "--dry-run", "--", *ARGS, env=fake_env, script=clone / "scripts" / "service")
    unit_path = Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT
    assert f"would write {unit_path}:" in proc.stdout
    assert "\nRestart=on-failure\n" in proc.stdout
    assert f"would run: systemctl --user enable --now {UNIT}" in proc.stdout
    assert "would run: " in proc.stdout, proc.stdout + proc.stderr
    assert "scripts/setup none" in proc.stdout, proc.stdout + proc.stderr
    assert calls(fake_env) == ["systemctl --user show-environment"]  # the read-only probe only
    assert not unit_path.exists()


def test_status_names_the_file_asks_systemctl_and_checks_the_recorded_port(clone, fake_env):
    script = clone / "scripts" / "service"
    service("install", "--systemd", "--", *ARGS, env=fake_env, script=script)
    Path(fake_env["FAKE_LOG"]).write_text("")
    proc = service("status", "--systemd", env=fake_env, script=script, check=False)
    assert proc.returncode == 3  # systemctl status's own exit status
    unit_path = Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT
    assert f"unit file: {unit_path}" in proc.stdout, proc.stdout + proc.stderr
    assert "fake status output" in proc.stdout, proc.stdout + proc.stderr
    assert "proxy: not answering on http://127.0.0.1:9090" in proc.stdout
    assert f"systemctl --user status {UNIT} --no-pager" in calls(fake_env)
    assert any(c.startswith("curl ") and "-x http://127.0.0.1:9090 http://codex-failover.status/" in c
               for c in calls(fake_env))


# -- the environment file ---------------------------------------------------------------------------

KEY = "sk-test-from-the-env-file"


def env_file(env) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) / "codex-failover" / "env"


def read_env_file(path: Path) -> dict[str, str]:
    """NAME='value' lines as systemd's EnvironmentFile= reads them (the subset the script writes)."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("=", 1)
            assert value.startswith("'") and value.endswith("'"), line
            out[name] = value[1:-1]
    return out


def test_install_env_writes_a_private_file_the_unit_reads_and_never_prints_a_value(clone, fake_env):
    script = clone / "scripts" / "service"
    env = {**fake_env, "SPARE_OPENAI_KEY": KEY, "SSL_CERT_FILE": "/etc/ssl/corp bundle.pem"}
    proc = service("install", "--systemd", "--env", "SPARE_OPENAI_KEY", "--env", "SSL_CERT_FILE", env=env, script=script)
    path = env_file(fake_env)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_env_file(path) == {"SPARE_OPENAI_KEY": KEY, "SSL_CERT_FILE": "/etc/ssl/corp bundle.pem"}
    unit = (Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT).read_text()
    assert unit_lines(unit)["EnvironmentFile"] == [f"-{path}"]
    assert KEY not in proc.stdout + proc.stderr
    assert "SPARE_OPENAI_KEY" in proc.stdout

    # Again with one more name: the earlier entries stay, the proxy restarts (its environment changed).
    Path(fake_env["FAKE_LOG"]).write_text("")
    proc = service("install", "--systemd", "--env", "OTHER_KEY", env={**fake_env, "OTHER_KEY": "sk-test-other"},
                   script=script)
    assert read_env_file(path) == {"SPARE_OPENAI_KEY": KEY, "SSL_CERT_FILE": "/etc/ssl/corp bundle.pem",
                                   "OTHER_KEY": "sk-test-other"}
    assert f"systemctl --user restart {UNIT}" in calls(fake_env)
    # The same values again: nothing changed, no restart.
    Path(fake_env["FAKE_LOG"]).write_text("")
    service("install", "--systemd", "--env", "OTHER_KEY", env={**fake_env, "OTHER_KEY": "sk-test-other"}, script=script)
    assert f"systemctl --user restart {UNIT}" not in calls(fake_env)


def test_install_env_dry_run_names_the_variables_only(clone, fake_env):
    proc = service("install", "--systemd", "--dry-run", "--env", "SPARE_OPENAI_KEY",
                   env={**fake_env, "SPARE_OPENAI_KEY": KEY}, script=clone / "scripts" / "service")
    assert f"would write {env_file(fake_env)} (mode 0600) with: SPARE_OPENAI_KEY" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr
    assert not env_file(fake_env).exists()


@pytest.mark.parametrize("name,value,why", [("SPARE_OPENAI_KEY", None, "is not set"), ("1BAD", "x", "not a variable name"),
                                            ("QUOTED", "it's", "holds a quote"), ("SLASHED", "a\\b", "holds a quote")])
def test_install_env_refuses_what_the_file_cannot_carry(clone, fake_env, name, value, why):
    env = {**fake_env, **({name: value} if value is not None else {})}
    proc = service("install", "--systemd", "--env", name, env=env, script=clone / "scripts" / "service", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert why in proc.stderr
    assert value is None or value not in proc.stderr
    assert not env_file(fake_env).exists()
    assert calls(fake_env) == []


def test_restart_asks_the_service_manager(clone, fake_env):
    script = clone / "scripts" / "service"
    service("restart", "--systemd", env=fake_env, script=script)
    assert calls(fake_env)[-1] == f"systemctl --user restart {UNIT}"
    service("install", "--launchd", env=fake_env, script=script)
    service("restart", "--launchd", env=fake_env, script=script)
    assert calls(fake_env)[-1] == f"launchctl kickstart -k gui/{os.getuid()}/{LABEL}"


SERVICE_RUN = ROOT / "scripts" / "service-run"


def test_service_run_rotates_a_log_over_its_cap_and_sources_the_env_file(tmp_path):
    log, env = tmp_path / "logs" / "proxy.log", tmp_path / "env"
    env.write_text("# comment\nSPARE_OPENAI_KEY='sk-test-x y'\n")
    log.parent.mkdir()
    log.write_text("x" * (1024 * 1024 + 1))
    cmd = ["env", "-i", f"HOME={tmp_path}", "PATH=/usr/bin:/bin", str(SERVICE_RUN), str(env), str(log), "1",
           "sh", "-c", 'echo "started with [$SPARE_OPENAI_KEY]"']
    subprocess.run(cmd, check=True, timeout=TIMEOUT)
    assert log.read_text() == "started with [sk-test-x y]\n"
    assert (log.parent / "proxy.log.1").stat().st_size == 1024 * 1024 + 1
    subprocess.run(cmd, check=True, timeout=TIMEOUT)  # under the cap: appended, not moved
    assert log.read_text().count("started") == 2
    env.unlink()
    subprocess.run(cmd, check=True, timeout=TIMEOUT)  # no env file: starts anyway
    assert log.read_text().endswith("started with []\n")


# -- a start with nothing but the environment file -----------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_a_clean_start_as_the_service_starts_it_reads_api_keys_from_the_env_file(tmp_path, fake_env, kind):
    """The pool names `api_key_env: SPARE_OPENAI_KEY`; the key is in this shell only when `install
    --env` runs. The proxy is then started with `env -i` exactly as the unit (ExecStart= after
    EnvironmentFile=) or the agent (ProgramArguments) would start it, and serves the spare."""
    from harness import MITMDUMP, STARTED, FakeUpstreamProcess, free_port, post_responses, stop, wait_port

    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    for name in ("service", "service-run"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    port = free_port()
    # scripts/run as the clone's would run it, with this checkout's mitmdump (no .venv to set up here).
    executable(root / "scripts" / "run", f"""#!/bin/sh
exec {shlex.quote(MITMDUMP)} --listen-host 127.0.0.1 -p {port} -s {shlex.quote(str(ROOT / "addon" / "failover.py"))} \\
    --set confdir={shlex.quote(str(tmp_path / "conf"))} "$@"
""")
    executable(root / "scripts" / "setup", "#!/bin/sh\nexit 0\n")
    fake = FakeUpstreamProcess(tmp_path)
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"credentials:\n  - name: spare\n    api_key_env: SPARE_OPENAI_KEY\n    base_url: {fake.base}/v1\n")
    args = ["--set", f"failover_config={pool}"]
    script = root / "scripts" / "service"
    service("install", f"--{kind}", "--env", "SPARE_OPENAI_KEY", "--", *args,
            env={**fake_env, "SPARE_OPENAI_KEY": KEY}, script=script)
    home = fake_env["HOME"]
    if kind == "systemd":
        unit = unit_lines((Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT).read_text())
        variables = read_env_file(Path(unit["EnvironmentFile"][0].lstrip("-")))
        argv = shlex.split(unit["ExecStart"][0])
        cwd = unit["WorkingDirectory"][0]
        log = None
    else:
        plist = plistlib.loads((Path(home) / "Library" / "LaunchAgents" / f"{LABEL}.plist").read_bytes())
        variables, argv, cwd = plist["EnvironmentVariables"], plist["ProgramArguments"], plist["WorkingDirectory"]
        log = Path(argv[2])
    env = ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", *(f"{k}={v}" for k, v in variables.items())]
    out = open(tmp_path / "proxy.out", "w")
    proc = subprocess.Popen([*env, *argv], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    STARTED.append(proc)
    try:
        wait_port(port, proc)
        reply = post_responses(port, f"{fake.base}/v1/responses", "sk-test-client-overload")
        assert reply.status == 200
        assert [r["credential"] for r in fake.model_requests()] == ["sk-test-client-overload", KEY]
    finally:
        stop(proc)
        out.close()
        fake.stop()
    text = (log or tmp_path / "proxy.out").read_text()
    assert "credentials: spare (apikey)" in text, text
    assert KEY not in text


# -- refusals and usage -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["unit", "install"])
def test_an_argument_that_looks_like_a_key_is_refused(command, clone, fake_env):
    key = "sk-proj-abcdefgh12345678"
    proc = service(command, "--systemd", "--", "--set", f"api_key={key}", env=fake_env,
                   script=clone / "scripts" / "service", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "argument 2" in proc.stderr, proc.stdout + proc.stderr
    assert "API key" in proc.stderr, proc.stdout + proc.stderr
    assert key not in proc.stderr
    assert calls(fake_env) == []
    assert not Path(fake_env["XDG_CONFIG_HOME"]).exists()


def test_paths_that_merely_contain_sk_dash_are_accepted():
    service("unit", "--systemd", "--", "--set", "failover_config=/home/me/disk-pools/sk-pool.yaml")


@pytest.mark.parametrize("argv", [["frobnicate"], [], ["--bogus", "unit"], ["status", "--", "-p", "1"],
                                  ["unit", "--dry-run"], ["unit", "extra"]])
def test_usage_errors_print_usage_and_exit_2(argv):
    proc = service(*argv, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "Usage: scripts/service" in proc.stderr


def test_help_prints_usage_and_exits_0():
    proc = service("--help")
    assert proc.stdout.startswith("Usage: scripts/service")
    assert "--dry-run" in proc.stdout, proc.stdout + proc.stderr
    assert service("help").stdout == proc.stdout


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    proc = subprocess.run(["shellcheck", str(SERVICE), str(SERVICE_RUN)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("given", [["--proxyauth", "me:t0ken-abc"], ["--proxyauth=me:t0ken-abc"],
                                   ["--set", "proxyauth=me:t0ken-abc"]])
def test_a_proxy_token_goes_to_the_private_environment_file_not_the_unit(clone, fake_env, given):
    script = clone / "scripts" / "service"
    unit_path = Path(fake_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / UNIT
    proc = service("install", "--systemd", "--", *given, "-p", "9090", env=fake_env, script=script)
    unit = unit_path.read_text()
    assert "t0ken-abc" not in unit and "proxyauth" not in unit_lines(unit)["ExecStart"][0], unit
    assert "-p 9090" in unit
    assert stat.S_IMODE(unit_path.stat().st_mode) == 0o600
    assert read_env_file(env_file(fake_env)) == {"CODEX_FAILOVER_PROXYAUTH": "me:t0ken-abc"}
    assert stat.S_IMODE(env_file(fake_env).stat().st_mode) == 0o600
    assert "t0ken-abc" not in proc.stdout + proc.stderr
    shown = service("unit", "--systemd", "--", *given, env=fake_env, script=script)
    assert "t0ken-abc" not in shown.stdout and "CODEX_FAILOVER_PROXYAUTH" in shown.stderr


def test_an_htpasswd_proxyauth_stays_an_argument(clone, fake_env):
    shown = service("unit", "--systemd", "--", "--proxyauth", "@/home/me/htpasswd", env=fake_env,
                    script=clone / "scripts" / "service")
    assert "--proxyauth @/home/me/htpasswd" in unit_lines(shown.stdout)["ExecStart"][0]
