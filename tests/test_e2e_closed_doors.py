"""End to end: the doors of issue 44 stay closed. Real mitmdump with the addon, the fake upstream,
clients of another uid (`setpriv`, when root), all on this host's loopback.

- A client (of another uid, or any) cannot tunnel back into the proxy by another spelling of its
  own address, nor reach the /metrics listener through it: refused by address.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from harness import FakeUpstreamProcess, ProxyProcess, free_port, pool_yaml

pytestmark = pytest.mark.e2e

SPARE = "sk-test-spare-good"
JUNK_503 = "sk-junk-http-503"
BODY = {"model": "gpt-fake", "stream": True, "input": [], "store": False}
SYSTEM_PYTHON = "/usr/bin/python3"  # another uid cannot read the test's venv; the clients need only the stdlib


def nobody() -> list[str]:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run a client as another user")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def run_client(prefix: list[str], code: str, *args: str, timeout: float = 30) -> dict:
    """Run a stdlib-only Python client (as another uid with `prefix`); its last stdout line is JSON."""
    python = SYSTEM_PYTHON if prefix else sys.executable
    done = subprocess.run([*prefix, python, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# CONNECT to TARGET through the proxy, then send REQUEST inside the tunnel; print what came back.
TUNNEL = r"""
import json, socket, sys
port, target, request = int(sys.argv[1]), sys.argv[2], sys.argv[3].encode().decode("unicode_escape").encode()
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    chunk = s.recv(4096)
    if not chunk:
        break
    head += chunk
connect_status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else ""
s.sendall(request)
got = b""
try:
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
        if b"\r\n\r\n" in got and (b"Hello from" in got or len(got) > 200000):
            break
except (socket.timeout, ConnectionError):
    pass
status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/") else ""
print(json.dumps({"connect": connect_status, "status": status, "body": got.decode("latin-1")[-3000:]}))
"""

# A plain-http GET through the proxy (absolute form).
GET = r"""
import json, socket, sys
port, url = int(sys.argv[1]), sys.argv[2]
host = url.split("/")[2]
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
got = b""
try:
    while chunk := s.recv(65536):
        got += chunk
except (socket.timeout, ConnectionError):
    pass
status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/") else ""
print(json.dumps({"status": status, "body": got.decode("latin-1")[-3000:]}))
"""


@pytest.fixture
def fake(tmp_path):
    upstream = FakeUpstreamProcess(tmp_path / "fake")
    yield upstream
    upstream.stop()


def spellings(port: int) -> list[str]:
    return [f"127.1:{port}", f"0.0.0.0:{port}", f"2130706433:{port}", f"[::ffff:127.0.0.1]:{port}",
            f"127.0.0.2:{port}", f"localhost:{port}"]


def test_another_uid_cannot_tunnel_back_into_the_proxy_by_another_spelling(tmp_path, fake):
    other = nobody()
    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)], use_client_credential=False)
    metrics = free_port()
    proxy = ProxyProcess(tmp_path, text, env, extra=["--listen-host", "0.0.0.0",
                                                     "--set", f"failover_metrics=127.0.0.1:{metrics}"])
    try:
        model = json.dumps(BODY)
        post = (f"POST http://localhost:{fake.port}/v1/responses HTTP/1.1\r\nHost: localhost:{fake.port}\r\n"
                f"authorization: Bearer {JUNK_503}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(model)}\r\nconnection: close\r\n\r\n{model}")
        status_get = "GET http://codex-failover.status/ HTTP/1.1\r\nHost: codex-failover.status\r\nconnection: close\r\n\r\n"
        reset = ("POST http://codex-failover.status/reset/spare HTTP/1.1\r\nHost: codex-failover.status\r\n"
                 "X-Codex-Failover: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        for target in spellings(proxy.port):
            for request in (status_get, reset):
                got = run_client(other, TUNNEL, proxy.port, target, request.encode("unicode_escape").decode())
                assert got["status"] != "200", (target, got)
                assert "spare" not in got["body"], (target, got)
            got = run_client(other, TUNNEL, proxy.port, target, post.encode("unicode_escape").decode())
            assert "Hello from" not in got["body"], (target, got)
        assert [r for r in fake.model_requests() if r["credential"] == SPARE] == []
        # /metrics through the proxy, by any spelling of its address: refused, for another uid and the proxy's own.
        for prefix in (other, []):
            for host in ("127.0.0.1", "127.1", "2130706433", "0.0.0.0", "[::ffff:127.0.0.1]"):
                got = run_client(prefix, GET, proxy.port, f"http://{host}:{metrics}/metrics")
                assert got["status"] != "200" and "codex_failover" not in got["body"], (host, got)
        log = proxy.log()
        assert "is this proxy's own listener" in log
        assert log.count("Traceback") == 0, log[-3000:]
        # The proxy still serves its own user.
        ok = run_client([], GET, proxy.port, "http://codex-failover.status/")
        assert ok["status"] == "200" and "spare" in ok["body"], ok
    finally:
        proxy.stop()
