"""End to end: hostile connections to the loopback relay of a real `mitmdump -s addon/failover.py`
(issue 14 item 6). Idle connections are closed quietly, and a bad token is refused before its body."""

from __future__ import annotations

import http.client
import json
import os
import selectors
import socket
import time

import pytest
from harness import ProxyProcess, pool_yaml

pytestmark = pytest.mark.e2e

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
LOOPBACK = "0100007F"  # 127.0.0.1, as /proc/net/tcp writes it


def listening_ports(pid: int) -> set[int]:
    """The 127.0.0.1 TCP ports process `pid` listens on: its socket inodes, matched in its
    network namespace's /proc/<pid>/net/tcp (which lists every socket, not only its own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == LISTEN and address == LOOPBACK and fields[9] in inodes:
                ports.add(int(port, 16))
    return ports


def relay_port(proxy: ProxyProcess, timeout: float = 10.0) -> int:
    """The relay's ephemeral port: the status report does not give it, so the one port mitmdump
    listens on besides the proxy's. The relay starts in `running`, just after the proxy port opens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        others = listening_ports(proxy.proc.pid) - {proxy.port}
        if len(others) == 1:
            return others.pop()
        assert len(others) < 2, f"more than one candidate relay port: {others}"
        time.sleep(0.05)
    raise TimeoutError("the relay never listened")


@pytest.fixture
def proxy(tmp_path):
    proc = ProxyProcess(tmp_path, None)
    yield proc
    proc.stop()


def closed_by_peer(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the peer sends until it closes, and when it closed (bounded by `timeout`)."""
    start = time.monotonic()
    sock.settimeout(0.2)
    data = b""
    while time.monotonic() - start < timeout:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def assert_quiet(log: str) -> None:
    assert "Traceback" not in log, log[-3000:]
    assert "Unhandled error" not in log, log[-3000:]
    assert "never retrieved" not in log, log[-3000:]


def test_idle_connections_are_closed_quietly(proxy):
    port = relay_port(proxy)
    # 100 that the client drops at once, and 300 held idle: the relay closes those itself at its
    # header deadline (5 s), each with one debug line and no traceback.
    for _ in range(100):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
    start = time.monotonic()
    with selectors.DefaultSelector() as sel:
        for sock in idle:
            sel.register(sock, selectors.EVENT_READ)
        open_ = set(idle)
        while open_ and time.monotonic() - start < 9:
            for key, _ in sel.select(timeout=0.5):
                sel.unregister(key.fileobj)
                open_.discard(key.fileobj)
    took = time.monotonic() - start
    for sock in idle:
        sock.close()
    assert not open_, f"{len(open_)} idle connections still open after {took:.1f}s"
    assert 3 < took < 8, took  # closed by the deadline, not at once and not never
    time.sleep(0.3)  # a traceback would have been logged by now
    assert_quiet(proxy.log())


def test_bad_token_trickling_a_huge_body_is_refused_at_once(proxy):
    port = relay_port(proxy)
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /r/not-a-token HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000000\r\n\r\nx")
    start = time.monotonic()
    sock.settimeout(3)
    first = sock.recv(65536)  # the 403 comes before any of the body is read
    assert first.startswith(b"HTTP/1.1 403"), first
    assert time.monotonic() - start < 2
    # Trickle on, a byte every 0.25 s: once the relay has hung up, a send fails (reset).
    hung_up = None
    while time.monotonic() - start < 8:
        try:
            sock.sendall(b"x")
        except OSError:
            hung_up = time.monotonic() - start
            break
        time.sleep(0.25)
    sock.close()
    assert hung_up is not None, hung_up
    assert hung_up < 4, hung_up
    time.sleep(0.3)
    assert_quiet(proxy.log())


def test_malformed_content_length_is_a_quiet_400(proxy):
    port = relay_port(proxy)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /r/whatever HTTP/1.1\r\ncontent-length: abc\r\n\r\n")
        data, _ = closed_by_peer(sock, 4)
    assert data.startswith(b"HTTP/1.1 400"), data
    time.sleep(0.3)
    assert_quiet(proxy.log())


def test_a_chunked_request_body_is_read_before_the_stream(fake, tmp_path):
    """mitmproxy forwards a chunked client body to the relay chunked: the relay must read it whole,
    not take its first byte for the reader leaving."""
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, env)
    try:
        url = f"{fake.base}/v1/responses"
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=15)
        body = json.dumps({"model": "gpt-fake", "stream": True, "input": [], "store": False}).encode()
        conn.request("POST", url, body=iter([body[:10], body[10:]]), encode_chunked=True,
                     headers={"authorization": "Bearer sk-test-client-good", "content-type": "application/json",
                              "accept": "text/event-stream", "transfer-encoding": "chunked"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        assert resp.status == 200, data[-500:]
        assert b"response.completed" in data, data[-500:]
        assert_quiet(proxy.log())
    finally:
        proxy.stop()
