"""How connection trouble shows in the log: a client that keeps failing its TLS handshake with the
proxy (core/handshake_watch.py), and an upstream the proxy could not reach, named (mitm/conn_trouble.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from codex_failover.core.handshake_watch import HandshakeWatch
from codex_failover.mitm.conn_trouble import ConnTrouble

NOW = 1_800_000_000.0


def test_a_client_closing_connections_it_opened_while_others_complete_is_not_news():
    """Codex, working: a handshake or two cut short now and then between completed ones."""
    watch = HandshakeWatch()
    for n in range(20):
        assert watch.failed("127.0.0.1", "chatgpt.com", "connection closed", NOW + n) is None
        if n % 2:
            watch.established("127.0.0.1", "chatgpt.com")
    assert watch.failed("127.0.0.1", "chatgpt.com", "connection closed", NOW + 30) is None


def test_repeated_failures_without_a_completed_handshake_are_reported_once():
    watch = HandshakeWatch()
    assert watch.failed("10.0.0.7", "chatgpt.com", "connection closed", NOW) is None
    assert watch.failed("10.0.0.7", "chatgpt.com", "eof", NOW + 1) is None
    line = watch.failed("10.0.0.7", "chatgpt.com", "connection closed", NOW + 2)
    assert line == ("client 10.0.0.7 failed 3 TLS handshakes in a row for chatgpt.com and completed none (last: "
                    "connection closed): it may not trust the proxy's certificate; give it mitmproxy's CA certificate "
                    "(for Codex: CODEX_CA_CERTIFICATE; docs/machine-proxy.md)")
    assert watch.failed("10.0.0.7", "chatgpt.com", "connection closed", NOW + 3) is None  # said already
    assert watch.failed("10.0.0.7", "chatgpt.com", "connection closed", NOW + 700) is not None  # ten minutes on
    assert watch.failed("10.0.0.8", "chatgpt.com", "connection closed", NOW + 701) is None  # another client


@pytest.mark.parametrize("error", ["tlsv1 alert unknown ca", "sslv3 alert bad certificate", "certificate unknown"])
def test_a_client_that_says_it_does_not_trust_the_ca_is_reported_at_once(error):
    line = HandshakeWatch().failed("127.0.0.1", "api.openai.com", error, NOW)
    assert line is not None and line.startswith(
        f"client 127.0.0.1 does not trust the proxy's certificate for api.openai.com (its TLS alert: {error})")


def test_the_watch_is_bounded():
    watch = HandshakeWatch(max_kept=4)
    for n in range(10):
        watch.failed(f"10.0.0.{n}", "h", "closed", NOW)
    assert len(watch._pairs) == 4


def _data(peer=("127.0.0.1", 5555), sni="chatgpt.com", error="connection closed"):
    client = SimpleNamespace(peername=peer, sni=sni)
    return SimpleNamespace(context=SimpleNamespace(client=client, server=SimpleNamespace(address=("chatgpt.com", 443))),
                           conn=SimpleNamespace(error=error))


def test_the_part_logs_the_watchs_line(caplog):
    part = ConnTrouble()
    with caplog.at_level(logging.INFO, logger="codex_failover"):
        for _ in range(3):
            part.tls_failed_client(_data(peer=("::ffff:10.1.2.3", 4000)))
        part.tls_established_client(_data())
        part.tls_failed_client(_data())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("codex-failover: client 10.1.2.3 failed 3 TLS handshakes")


def test_a_connect_error_names_the_host(caplog):
    data = SimpleNamespace(server=SimpleNamespace(address=("chatgpt.com", 443),
                                                  error="[Errno -2] Name or service not known"),
                           client=SimpleNamespace(peername=("127.0.0.1", 5000)))
    with caplog.at_level(logging.INFO, logger="codex_failover"):
        ConnTrouble().server_connect_error(data)
    assert [r.getMessage() for r in caplog.records] == [
        "error establishing server connection to chatgpt.com:443 (for client 127.0.0.1): [Errno -2] Name or service "
        "not known"]


# -- end to end: mitmdump and curl ---------------------------------------------------------------


@pytest.mark.e2e
def test_a_client_without_the_ca_and_an_unknown_host_in_the_log(fake, start_proxy):
    """curl without mitmproxy's CA: one line that says so (its alert), not mitmproxy's guess; a host
    that does not resolve: a line that names it."""
    import subprocess

    from harness import wait_until

    proxy = start_proxy(fake, [("spare", "sk-test-spare-good")])
    for _ in range(2):
        subprocess.run(["curl", "-s", "-m", "10", "-x", f"http://127.0.0.1:{proxy.port}", "https://api.openai.com/v1/models"],
                       capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin", "HOME": str(proxy.confdir)})
    subprocess.run(["curl", "-s", "-m", "10", "-x", f"http://127.0.0.1:{proxy.port}", "http://nowhere.invalid/"],
                   capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin", "HOME": str(proxy.confdir)})
    log = wait_until(lambda: proxy.log() if "nowhere.invalid" in proxy.log() else None, 10, "the connect error's line")
    said = [line for line in log.splitlines() if "trust the proxy's certificate" in line]
    assert len(said) == 1, log[-2000:]
    assert "codex-failover: client 127.0.0.1 does not trust the proxy's certificate for api.openai.com" in said[0]
    assert "Client TLS handshake failed" not in log
    assert "error establishing server connection to nowhere.invalid:80 (for client 127.0.0.1)" in log, log[-2000:]
