"""README.md's "Use it as your machine's proxy" shell block, run as written (in bash and in zsh),
then every kind of shell a user opens must see the proxy variables and Codex's CA: bash login and
interactive, zsh login and not. (The Codex CLI through the proxy on these variables alone:
test_codex_cli.py, test_real_codex_on_the_readme_variables_alone.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- the block below is run as written by tests/test_readme_block.py -->"
TIMEOUT = 20
NAMES = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy", "CODEX_CA_CERTIFICATE")


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    after = text.split(MARKER, 1)[1]
    match = re.match(r"\s*```sh\n(.*?)```", after, re.S)
    assert match, "the marked block is not a ```sh block"
    return match.group(1)


def shell(argv: list[str], home: Path, command: str) -> subprocess.CompletedProcess:
    """`argv` + command in a clean environment: HOME and PATH only, as a new terminal would start."""
    return subprocess.run(["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", "TERM=dumb", *argv, command],
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, cwd=home)


def seen(argv: list[str], home: Path) -> dict[str, str]:
    out = shell(argv, home, "for n in " + " ".join(NAMES) + "; do printf '%s=%s\\n' \"$n\" \"$(printenv \"$n\")\"; done")
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line and line.split("=", 1)[0] in NAMES)


SHELLS = {"bash login": ["bash", "-l", "-c"], "bash interactive": ["bash", "-i", "-c"],
          "zsh login": ["zsh", "-l", "-c"], "zsh": ["zsh", "-c"], "sh login": ["sh", "-l", "-c"]}


@pytest.mark.parametrize("runner", ["bash", "zsh"])
def test_the_readme_block_reaches_every_shell(tmp_path, runner):
    if not shutil.which("zsh"):
        pytest.skip("zsh is not installed (Debian: apt-get install zsh)")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("case $- in *i*) ;; *) return ;; esac\n")  # Debian's early return
    for _ in range(2):  # pasted twice: still one line in each file
        proc = shell([runner, "-c"], home, readme_block())
        assert proc.returncode == 0, proc.stderr
    for rc in (".profile", ".bashrc", ".zshenv"):
        assert (home / rc).read_text().count("codex-failover/proxy.sh") == 1, rc
    want = {n: "http://127.0.0.1:8080" for n in NAMES[:4]}
    want |= {"NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1",
             "CODEX_CA_CERTIFICATE": f"{home}/.mitmproxy/mitmproxy-ca-cert.pem"}
    for name, argv in SHELLS.items():
        assert seen(argv, home) == want, name


GENERATOR = Path("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator")


def machine_proxy_block(starts: str) -> str:
    """The indented ```sh block of docs/machine-proxy.md whose first line is `starts`, unindented."""
    text = (ROOT / "docs" / "machine-proxy.md").read_text()
    for match in re.finditer(r"\n( *)```sh\n(.*?)\n\1```", text, re.S):
        indent, body = match.group(1), match.group(2)
        lines = [line[len(indent):] for line in body.splitlines()]
        if lines and lines[0] == starts:
            return "\n".join(lines) + "\n"
    raise AssertionError(f"no block starting with {starts!r}")


@pytest.mark.skipif(not GENERATOR.exists(), reason="systemd's environment.d generator is not installed")
def test_the_environment_d_block_is_what_systemd_gives_the_desktop_session(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = shell(["bash", "-c"], home, machine_proxy_block("mkdir -p ~/.config/environment.d"))
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run(["env", "-i", f"HOME={home}", f"XDG_CONFIG_HOME={home}/.config", str(GENERATOR)],
                         capture_output=True, text=True, timeout=TIMEOUT, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {n: env.get(n) for n in NAMES} == {
        **{n: "http://127.0.0.1:8080" for n in NAMES[:4]}, "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1", "CODEX_CA_CERTIFICATE": f"{home}/.mitmproxy/mitmproxy-ca-cert.pem"}
