"""End to end: the proxy under slow, huge and hostile input (issue 14). Memory figures are RSS
read from /proc; each bound is stated next to its check."""

from __future__ import annotations

import socket
import time

import pytest

from harness import FakeUpstreamProcess, ProxyProcess, pool_yaml, start_raw_post

pytestmark = pytest.mark.e2e


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_reads_nothing_does_not_make_the_proxy_buffer_the_stream(tmp_path):
    """200 MiB from a fast upstream to a client that reads nothing: the attempt stops reading
    (backpressure) and the proxy's RSS grows by at most 64 MiB (it grew by ~300 MB per such client)."""
    fake = FakeUpstreamProcess(tmp_path, "--flood-mib", "200")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    sock = None
    try:
        before = rss_mib(proxy.proc.pid)
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-flood")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.recv(4096)  # the response began: committed
        peak = before
        for _ in range(30):  # 3 s: unbounded buffering absorbed all 200 MiB in under 1 s
            time.sleep(0.1)
            peak = max(peak, rss_mib(proxy.proc.pid))
        assert peak - before <= 64, f"RSS grew by {peak - before:.0f} MiB"
        # The stream is intact once the client reads: a few MiB come through in order.
        sock.settimeout(10)
        got = 0
        while got < 8 * 1024 * 1024:
            chunk = sock.recv(1 << 20)
            assert chunk, "the stream ended early"
            got += len(chunk)
    finally:
        if sock is not None:
            sock.close()
        proxy.stop()
        fake.stop()


def test_response_timeout_below_connect_timeout_is_honoured(tmp_path):
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    text, env = pool_yaml(fake.base, [], response_timeout="1s", connect_timeout="10s")
    text = text.replace("credentials:\n", f"base_urls: [{fake.base}/v1]\ncredentials: []\n")
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        started = time.monotonic()
        sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-stall-headers", timeout=15)
        sock.settimeout(15)
        head = sock.recv(4096)
        took = time.monotonic() - started
        sock.close()
    finally:
        proxy.stop()
        fake.stop()
    assert head.startswith(b"HTTP/1.1 502"), head[:200]
    assert took < 4, f"answered after {took:.1f}s, response_timeout is 1s"
