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
from harness import FakeUpstreamProcess, ProxyProcess, free_port, pool_yaml, proxy_status

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


# -- passed-through traffic streamed ------------------------------------------------------------

MIB = 1024 * 1024
BULK = 128 * MIB  # the test's body; docs/measurements.md has 300 MiB against plain mitmdump


def peak_kib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def post_bulk(port: int, url: str, size: int) -> bytes:
    import socket

    host = url.split("/")[2]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {url} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/octet-stream\r\n"
                  f"content-length: {size}\r\nconnection: close\r\n\r\n".encode())
        block, sent = bytes(MIB), 0
        while sent < size:
            s.sendall(block[:min(MIB, size - sent)])
            sent += min(MIB, size - sent)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def post_bulk_model(port: int, url: str, size: int) -> bytes:
    import socket

    host = url.split("/")[2]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {url} HTTP/1.1\r\nHost: {host}\r\nauthorization: Bearer {SPARE}-own\r\n"
                  f"content-type: application/json\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n".encode())
        block, sent = b" " * MIB, 0
        while sent < size:
            s.sendall(block[:min(MIB, size - sent)])
            sent += min(MIB, size - sent)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def get_bulk(port: int, url: str) -> int:
    import socket

    host = url.split("/")[2]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nconnection: close\r\n\r\n".encode())
        n = 0
        while chunk := s.recv(1 << 20):
            n += len(chunk)
    return n


def test_a_request_the_addon_answers_itself_is_never_read_whole(tmp_path):
    """The status page (and a refused client's model request) is answered by the addon, never sent on:
    a body over 64 KiB there is closed unread, not gathered whole before the answer."""
    from bulk_upstream import BulkUpstream

    bulk = BulkUpstream()
    text, env = pool_yaml(f"http://127.0.0.1:{bulk.port}", [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        assert proxy_status(proxy.port)["credentials"]  # warm
        before = peak_kib(proxy.proc.pid)
        try:
            post_bulk(proxy.port, "http://codex-failover.status/reset/spare", BULK)
        except OSError:
            pass  # closed while it was still sending: what is wanted
        grown = (peak_kib(proxy.proc.pid) - before) / 1024
        assert grown < 24, f"the proxy grew {grown:.0f} MiB for a {BULK // MIB} MiB body to the status page"
        assert "closed unread (the addon answers it itself)" in proxy.log()
        assert proxy_status(proxy.port)["credentials"]  # still serving
    finally:
        proxy.stop()
        bulk.stop()


DRIP = r"""
import json, socket, sys, time
port, url, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
host = url.split("/")[2]
body = json.dumps({"model": "gpt-fake", "stream": True, "input": []})
s = socket.create_connection(("127.0.0.1", port), timeout=10)
start = time.monotonic()
s.sendall((f"POST {url} HTTP/1.1\r\nHost: {host}\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\n"
           f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n{body}").encode())
seen, got = [], b""
while chunk := s.recv(65536):
    got += chunk
    for i in range(5):
        if f"part {i}".encode() in got and len(seen) == i:
            seen.append(time.monotonic() - start)
print(json.dumps({"seen": seen, "status": got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/") else ""}))
"""


def test_passed_through_bodies_are_streamed_not_buffered(tmp_path):
    from bulk_upstream import BulkUpstream

    bulk = BulkUpstream()
    text, env = pool_yaml(f"http://127.0.0.1:{bulk.port}", [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        other = f"http://127.0.0.1:{bulk.port}/upload"
        assert b'"received": 16' in post_bulk(proxy.port, other, 16)  # warm: the proxy's code paths loaded
        assert get_bulk(proxy.port, f"http://127.0.0.1:{bulk.port}/big?n=16") > 16
        before = peak_kib(proxy.proc.pid)
        answer = post_bulk(proxy.port, other, BULK)
        assert f'"received": {BULK}'.encode() in answer, answer[-300:]
        assert get_bulk(proxy.port, f"http://127.0.0.1:{bulk.port}/big?n={BULK}") > BULK
        grown = (peak_kib(proxy.proc.pid) - before) / 1024
        assert grown < 24, f"the proxy grew {grown:.0f} MiB passing {BULK // MIB} MiB each way"
        # The user's own model request over failover_max_body (32 MiB): never read whole, streamed on.
        model = post_bulk_model(proxy.port, f"http://127.0.0.1:{bulk.port}/v1/responses", BULK)
        assert b"part 4" in model, model[-300:]
        grown = (peak_kib(proxy.proc.pid) - before) / 1024
        assert grown < 24, f"the proxy grew {grown:.0f} MiB for an own model request over failover_max_body"
        assert "passed through untouched, without failover" in proxy.log()
    finally:
        proxy.stop()
        bulk.stop()


def test_another_uids_model_stream_arrives_as_it_comes(tmp_path):
    from bulk_upstream import GAP, BulkUpstream

    other = nobody()
    bulk = BulkUpstream()
    text, env = pool_yaml(f"http://127.0.0.1:{bulk.port}", [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        got = run_client(other, DRIP, proxy.port, f"http://127.0.0.1:{bulk.port}/v1/responses", JUNK_503)
        assert got["status"] == "200" and len(got["seen"]) == 5, got
        first, last = got["seen"][0], got["seen"][-1]
        assert last - first > 3 * GAP, got  # each delta when it was sent, not all at the end
    finally:
        proxy.stop()
        bulk.stop()


# -- what a web page can do ----------------------------------------------------------------------

CHROMIUM = os.environ.get("CODEX_FAILOVER_CHROMIUM", "/usr/bin/chromium")


def global_address() -> str | None:
    """An IPv4 address of this host that is not loopback: a page served there is an insecure origin,
    whose same-origin requests carry neither Origin nor Sec-Fetch-* (a loopback one gets Sec-Fetch-*)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3), None)


@pytest.fixture
def insecure_page():
    host = global_address()
    if host is None:
        pytest.skip("no non-loopback address on this host for an insecure page origin")
    yield from _page_server(host)


@pytest.fixture
def page_origin():
    yield from _page_server("127.0.0.1")


def _page_server(host: str):
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"<!doctype html><title>a page</title><p>another origin"
            kind = "text/html"
            if self.path.endswith("/wham/usage"):  # the page's own server says the account is at its limit
                body, kind = json.dumps({"rate_limit": {"allowed": False, "limit_reached": True}}).encode(), "application/json"
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, 0), Page)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield f"http://{host}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def browse(proxy_port: int, url: str, script: str, arg=None):
    try:
        from playwright import sync_api
    except ImportError:
        pytest.skip("playwright is not installed (scripts/setup test installs pyproject's test extra)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=15_000,
                                     args=[f"--proxy-server=http://127.0.0.1:{proxy_port}",
                                           "--proxy-bypass-list=<-loopback>"])
        try:
            page = browser.new_page()
            page.goto(url, timeout=15_000)
            return page.evaluate(script, arg)
        finally:
            browser.close()


RESETS = """async () => {
  const out = [];
  for (const mode of ["no-cors", "cors"]) {
    try {
      const r = await fetch("http://codex-failover.status/reset/spare", {method: "POST", mode,
                             headers: mode === "cors" ? {"X-Codex-Failover": "1"} : {}});
      out.push(mode + ":" + r.status);
    } catch (e) { out.push(mode + ":failed"); }
  }
  const form = document.createElement("form");  // a plain form post, as a CSRF page makes one
  form.method = "POST"; form.action = "http://codex-failover.status/reset/spare"; form.target = "sink";
  const sink = document.createElement("iframe"); sink.name = "sink"; document.body.append(sink, form);
  form.submit();
  await new Promise(r => setTimeout(r, 1500));
  return out;
}"""


def test_a_web_page_cannot_end_a_cooldown(tmp_path, fake, page_origin):
    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        got = browse(proxy.port, page_origin + "/", RESETS)
        assert "cors:200" not in got, got  # the preflight finds no CORS answer: the request never goes
        log = proxy.log()
        assert "nothing to end" not in log and "cooldown ended" not in log, log[-2000:]
        assert "a reset from the status page refused" in log
    finally:
        proxy.stop()


USAGE = """async ([token]) => {
  const r = await fetch("/backend-api/wham/usage", {headers: {"Authorization": "Bearer " + token,
                                                              "ChatGPT-Account-ID": "acct-page"}});
  return {status: r.status, header: r.headers.get("x-codex-failover-usage"), text: await r.text()};
}"""


def test_a_web_page_never_reads_a_pooled_accounts_usage(tmp_path, fake, insecure_page):
    import base64
    import time

    def jwt(claims):
        enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
        return f"{enc({'alg': 'none'})}.{enc(claims)}.sig"

    lines = ["credentials:"]
    for name in ("a", "b"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens": {"access_token": jwt({"exp": time.time() + 3600, "sub": name}),
                                               "account_id": f"acct-{name}"}}))
        lines += [f"  - name: {name}", f"    auth_file: {path}", f"    base_url: {fake.base}/backend-api/codex"]
    proxy = ProxyProcess(tmp_path, "\n".join(lines) + "\n")
    try:
        got = browse(proxy.port, insecure_page + "/", USAGE, [jwt({"exp": time.time() + 60, "sub": "page"})])
        assert got["status"] == 200 and got["header"] is None, got
        assert "codex_failover" not in got["text"] and "acct-a" not in got["text"], got
        assert [r for r in fake.requests() if r.get("scenario") == "usage"] == []  # no pooled account was asked
    finally:
        proxy.stop()


# -- files that could hang or swell the proxy -----------------------------------------------------

def test_a_fifo_dev_zero_or_huge_file_in_place_of_the_pool_or_auth_file_costs_one_line(tmp_path, fake):
    import base64
    import time

    from harness import post_responses, served_by

    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    auth = tmp_path / "work.json"
    auth.write_text(json.dumps({"tokens": {"access_token": f"{enc({'alg': 'none'})}.{enc({'exp': time.time() + 3600})}.s",
                                           "account_id": "acct-work"}}))
    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)])
    text = text.replace("credentials:\n", f"credentials:\n  - name: work\n    auth_file: {auth}\n"
                                          f"    base_url: http://localhost:{fake.port}/backend-api/codex\n", 1)
    proxy = ProxyProcess(tmp_path, text, env)
    pool = tmp_path / "pool.yaml"
    url = f"http://localhost:{fake.port}/v1/responses"

    def canary(mark: str) -> None:
        reply = post_responses(proxy.port, url, "sk-test-mine-overload-503", BODY, timeout=10)
        assert reply.status == 200 and served_by(reply) == SPARE, (mark, reply.status, reply.body[-300:])

    def swap(path, make) -> None:
        new = path.with_name(path.name + ".new")
        make(new)
        os.replace(new, path)
        time.sleep(1.1)  # the files are looked at, at most once a second

    try:
        canary("before")
        swap(pool, os.mkfifo)
        canary("a FIFO")
        swap(pool, lambda p: os.symlink("/dev/zero", p))
        canary("/dev/zero")

        def huge(p):
            with open(p, "wb") as f:
                f.truncate(150 * 1024 * 1024)  # sparse: 150 MiB to read, none on disk
        swap(pool, huge)
        canary("150 MiB")
        swap(auth, os.mkfifo)
        canary("an auth FIFO")
        swap(auth, lambda p: os.symlink("/dev/zero", p))
        canary("an auth /dev/zero")
        log = proxy.log()
        for line in ("it is a FIFO, not a regular file", "it is a character device, not a regular file",
                     "150 MiB, over the 4 MiB this file may be"):
            assert line in log, (line, log[-3000:])
        assert log.count("Traceback") == 0, log[-3000:]
        assert "acct-work" not in log
    finally:
        proxy.stop()


# -- the proxy token out of argv -----------------------------------------------------------------

TOKEN = "me:s3cr3t-t0ken-44"


def status_with(port: int, token: str | None) -> int:
    import base64
    import socket

    auth = f"Proxy-Authorization: Basic {base64.b64encode(token.encode()).decode()}\r\n" if token else ""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET http://codex-failover.status/ HTTP/1.1\r\nHost: codex-failover.status\r\n{auth}"
                  "Connection: close\r\n\r\n".encode())
        head = s.recv(200)
    return int(head.split(b" ", 2)[1])


@pytest.mark.parametrize("how", ["env", "file"])
def test_the_proxy_token_from_the_environment_or_a_private_file_never_in_argv(tmp_path, fake, how):
    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)])
    extra = []
    if how == "env":
        env["CODEX_FAILOVER_PROXYAUTH"] = TOKEN
    else:
        path = tmp_path / "proxyauth"
        path.write_text(TOKEN + "\n")
        path.chmod(0o600)
        extra = ["--set", f"failover_proxyauth_file={path}"]
    proxy = ProxyProcess(tmp_path, text, env, extra=extra)
    try:
        assert status_with(proxy.port, None) == 407
        assert status_with(proxy.port, "me:wrong") == 407
        assert status_with(proxy.port, TOKEN) == 200
        cmdline = open(f"/proc/{proxy.proc.pid}/cmdline", "rb").read()
        assert b"s3cr3t" not in cmdline
        assert "holders of the proxy token" in proxy.log() and "s3cr3t" not in proxy.log()
    finally:
        proxy.stop()


def test_a_proxy_token_file_others_may_read_stops_the_start_with_one_line(tmp_path):
    from harness import MITMDUMP, ROOT

    path = tmp_path / "proxyauth"
    path.write_text(TOKEN)
    path.chmod(0o644)
    (tmp_path / "home").mkdir()
    done = subprocess.run([MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(free_port()), "--set",
                           f"confdir={tmp_path / 'conf'}", "-s", str(ROOT / "addon" / "failover.py"),
                           "--set", f"failover_proxyauth_file={path}"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "state")})
    assert done.returncode != 0
    assert "failover_proxyauth_file" in done.stderr + done.stdout and "chmod 600" in done.stderr + done.stdout
    assert "s3cr3t" not in done.stderr + done.stdout


# -- descriptors ---------------------------------------------------------------------------------

HOLD = r"""
import json, resource, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: exam")  # half a head, never the rest
    held.append(s)
print(json.dumps({"held": len(held)}), flush=True)
sys.stdin.read()  # until the test is done
"""


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_half_sent_connects_of_another_uid_leave_the_proxy_serving(tmp_path, fake):
    import resource
    import time

    other = nobody()
    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip(f"the hard descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # as a service manager often starts a service
    try:
        proxy = ProxyProcess(tmp_path, text, env, extra=["--set", "failover_head_timeout=4s",
                                                         "--set", "failover_max_connections=200"])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    flood = subprocess.Popen([*other, SYSTEM_PYTHON, "-c", HOLD, str(proxy.port), "1100"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert json.loads(flood.stdout.readline())["held"] == 1100
        before = peak_kib(proxy.proc.pid)
        started = time.monotonic()
        canary = run_client([], GET, proxy.port, "http://codex-failover.status/", timeout=10)
        assert canary["status"] == "200" and time.monotonic() - started < 3, canary
        open_fds = fd_count(proxy.proc.pid)
        assert open_fds < 400, open_fds  # the uid's first 200 held; the rest refused at once
        wait = time.monotonic() + 10
        while fd_count(proxy.proc.pid) > 100 and time.monotonic() < wait:
            time.sleep(0.2)
        assert fd_count(proxy.proc.pid) < 100  # and those dropped: no whole head within 4 s
        log = proxy.log()
        assert "connections refused: uid:65534 holds failover_max_connections (200)" in log, log[-2000:]
        assert "clients dropped: no whole request head within failover_head_timeout" in log
        print(f"held={open_fds} fds, rss peak grew {(peak_kib(proxy.proc.pid) - before) / 1024:.1f} MiB")
    finally:
        flood.stdin.close()
        flood.wait(timeout=10)
        proxy.stop()


# -- numbers from outside ------------------------------------------------------------------------

def test_absurd_numbers_in_usage_headers_and_state_rows_break_nothing(tmp_path, fake):
    import sqlite3

    from harness import post_responses, proxy_status, served_by

    text, env = pool_yaml(f"http://localhost:{fake.port}", [("spare", SPARE)])
    url = f"http://localhost:{fake.port}/v1/responses"
    mine = "sk-test-mine-good"
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        fake.overload_next(SPARE, scenario="window-absurd")
        fake.overload_next(mine, scenario="window-absurd")
        first = post_responses(proxy.port, url, mine, BODY)
        assert first.status == 200, first.body[-300:]
        status = proxy_status(proxy.port)  # the page still renders: every time in it a sane one
        assert status["credentials"], status
        again = post_responses(proxy.port, url, mine, BODY)
        assert again.status == 200, again.body[-300:]
    finally:
        proxy.stop()
    # A state row from another version (or a teammate's proxy): a cooldown `until: Infinity`.
    db = next((tmp_path / "state").rglob("state.sqlite"))
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT rowid, value FROM state").fetchall()
        assert rows
        for rowid, value in rows:
            doc = json.loads(value)
            for field in ("until", "seen"):
                if field in doc:
                    doc[field] = float("inf")
            if "windows" in doc:
                doc["windows"] = [[n, float("inf"), 1e20] for n, *_ in doc["windows"]]
            conn.execute("UPDATE state SET value = ? WHERE rowid = ?", (json.dumps(doc), rowid))
        conn.execute("INSERT OR REPLACE INTO state (namespace, kind, id, value, expires) SELECT namespace, 'cooling', id, "
                     "'{\"until\": Infinity, \"reason\": \"overloaded\"}', expires FROM state LIMIT 1")
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        reply = post_responses(proxy.port, url, mine, BODY)
        assert reply.status == 200 and served_by(reply) is not None, reply.body[-300:]
        assert proxy_status(proxy.port)["credentials"]
        assert "Traceback" not in proxy.log(), proxy.log()[-3000:]
    finally:
        proxy.stop()


# -- mitmweb ---------------------------------------------------------------------------------------

def test_mitmweb_serves_the_content_of_every_flow(tmp_path, fake):
    import urllib.error

    from harness import MitmwebProcess, WsClient, post_responses, request

    text, env = pool_yaml(fake.base, [("spare", SPARE)])
    web = MitmwebProcess(tmp_path, text, env)
    try:
        for key in ("sk-test-mine-overload-503", "sk-test-mine-overload", "sk-test-good"):
            assert post_responses(web.port, f"{fake.base}/v1/responses", key).status == 200
        fake.overload_next("sk-test-mine-b", scenario="usage-limit")
        post_responses(web.port, f"{fake.base}/v1/responses", "sk-test-mine-b", timeout=20)
        assert request(web.port, "GET", f"{fake.base}/other").status == 200  # passed through, streamed
        request(web.port, "POST", f"{fake.base}/v1/responses", {"authorization": "Bearer sk-x-other",
                                                                "content-type": "application/json"}, b'{"stream": false}')
        fake.overload_next("sk-test-mine-ws", scenario="overload")
        ws = WsClient.connect(web.port, f"{fake.base}/v1/responses", {"authorization": "Bearer sk-test-mine-ws"})
        assert isinstance(ws, WsClient)
        ws.send_json({"type": "response.create", "model": "gpt-fake", "input": []})
        assert ws.recv_turn()[-1]["type"] == "response.completed"
        flows = web.api("/flows")
        assert len(flows) >= 10
        failed = []
        for flow in flows:
            for part in ("request", "response"):
                if part == "response" and not flow.get("response"):
                    continue
                for view in ("content.data", "content/Auto.json"):
                    try:
                        web.api(f"/flows/{flow['id']}/{part}/{view}", raw=True)
                    except urllib.error.HTTPError as exc:
                        failed.append((flow["request"]["path"], part, view, exc.code))
        assert failed == [], failed
        other = next(f for f in flows if f["request"]["path"] == "/other")
        assert web.api(f"/flows/{other['id']}/response/content.data", raw=True)  # its streamed start, kept
    finally:
        web.stop()


# -- HTTP/2 resets ---------------------------------------------------------------------------------

def test_a_rapid_reset_costs_no_upstream_work(tmp_path, tls_fake):
    import h2.errors
    from h2_client import H2Client, H2Stream

    text = f"base_urls: [{tls_fake.base}/v1]\npolicy: {{bootstrap_timeout: 5s}}\n"
    proxy = ProxyProcess(tmp_path / "proxy", text, extra=["--set", "ssl_insecure=true"])
    client = None
    try:
        client = H2Client(proxy.port, f"127.0.0.1:{tls_fake.port}", proxy.confdir / "mitmproxy-ca-cert.pem")
        body = json.dumps({"model": "gpt-fake", "stream": True, "input": []}).encode()
        with client.lock:  # each stream opened and reset at once, all in one write
            for _ in range(200):
                sid = client.conn.get_next_available_stream_id()
                client.conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"),
                                               (":authority", client.authority), (":path", "/v1/responses"),
                                               ("authorization", "Bearer sk-test-client-good"),
                                               ("content-type", "application/json"), ("content-length", str(len(body)))])
                client.conn.send_data(sid, body, end_stream=True)
                client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            client._flush()
        canary = client.wait(client.post_model("sk-test-client-good"), timeout=15)
        assert canary.status == 200 and b"response.completed" in canary.data
        import time
        time.sleep(1.0)
        sent = len(tls_fake.model_requests())
        assert sent <= 1 + 5, f"{sent - 1} model requests sent upstream for streams reset at once"
        assert isinstance(canary, H2Stream)
    finally:
        if client is not None:
            client.close()
        proxy.stop()


def test_a_reset_before_the_first_verdict_moves_nothing_to_the_pool(tmp_path, tls_fake):
    import time

    from h2_client import H2Client

    text, env = pool_yaml(tls_fake.base, [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", "ssl_insecure=true"])
    client = None
    try:
        client = H2Client(proxy.port, f"127.0.0.1:{tls_fake.port}", proxy.confdir / "mitmproxy-ca-cert.pem")
        stream = client.post_model("sk-test-client-stall-headers")  # no head: the first verdict waits
        time.sleep(0.8)
        client.reset(stream)
        time.sleep(2.0)
        spare = [r for r in tls_fake.model_requests() if r["credential"] == SPARE]
        assert spare == [], f"the pool was asked for a client that had reset its stream: {spare}"
        assert "client went away" in proxy.log()
    finally:
        if client is not None:
            client.close()
        proxy.stop()


def test_a_passed_through_websocket_message_is_bounded(tmp_path, fake):
    import socket

    from harness import WsClient
    from wsproto.events import BytesMessage

    text, env = pool_yaml(fake.base, [("spare", SPARE)])
    proxy = ProxyProcess(tmp_path, text, env, extra=["--set", "failover_max_body=4m"])
    try:
        # A web page's WebSocket (Origin): passed through on its own key, never gated.
        ws = WsClient.connect(proxy.port, f"{fake.base}/v1/responses",
                              {"authorization": "Bearer sk-test-page-good", "origin": "https://page.example"})
        assert isinstance(ws, WsClient), ws
        before = peak_kib(proxy.proc.pid)
        block = bytes(1024 * 1024)
        data = ws.ws.send(BytesMessage(data=block * 64))  # one 64 MiB message
        ws.sock.settimeout(10)
        closed = False
        try:
            for i in range(0, len(data), 1 << 20):
                ws.sock.sendall(data[i:i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            closed = True
        if not closed:
            try:
                closed = ws.sock.recv(65536) == b"" or True
            except (ConnectionResetError, socket.timeout):
                closed = True
        grown = (peak_kib(proxy.proc.pid) - before) / 1024
        assert grown < 24, f"the proxy grew {grown:.0f} MiB for one 64 MiB message passed through"
        assert "passed-through WebSocket message grew past failover_max_body" in proxy.log()
    finally:
        proxy.stop()
