"""Unit tests: who may use the pool, which hosts are intercepted, where the system trust store is,
and that a request without its own credential never gets the pool's (issue 12). Pure, no I/O."""

from __future__ import annotations

import pytest

from codex_failover.config import parse_pool
from codex_failover.core.auth import auth_from_document
from codex_failover.core.client_access import ClientAccess, ClientAccessError, is_loopback_host, parse_networks
from codex_failover.core.health import Health
from codex_failover.core.intercept_scope import InterceptScope
from codex_failover.core.planner import make_plan
from codex_failover.net.trust import SYSTEM_BUNDLES, system_locations


@pytest.mark.parametrize("address, extra, allowed", [
    ("127.0.0.1", [], True),
    ("127.8.9.10", [], True),
    ("::1", [], True),
    ("::ffff:127.0.0.1", [], True),  # a dual-stack listener's view of an IPv4 loopback client
    ("10.0.0.5", [], False),
    ("100.64.1.2", [], False),  # CGNAT / Tailscale: mitmproxy's block_global does not cover it
    ("192.168.1.7", ["192.168.1.0/24"], True),
    ("192.168.2.7", ["192.168.1.0/24"], False),
    ("10.0.0.5", ["10.0.0.5"], True),
    ("::ffff:10.0.0.5", ["10.0.0.5"], True),
    ("fd00::1", ["fd00::/8"], True),
    ("fd00::1", ["10.0.0.0/8"], False),
    ("fe80::1%eth0", ["fe80::/10"], True),
    ("", [], False),
    (None, [], False),
    ("not-an-ip", [], False),
])
def test_client_access(address, extra, allowed):
    assert ClientAccess(parse_networks(extra)).allows(address) is allowed


def test_client_access_asked_again_answers_the_same_and_remembers_a_bounded_number():
    from codex_failover.core import client_access
    access = ClientAccess(parse_networks(["10.0.0.0/8"]))
    for _ in range(2):  # the second time from what it remembered
        assert [access.allows(a) for a in ("127.0.0.1", "10.1.2.3", "192.168.1.1", "junk", "", None)] == \
            [True, True, False, False, False, False]
    for i in range(client_access._REMEMBERED * 3):
        access.allows(f"192.168.{i // 250}.{i % 250}")
    assert len(access._answers) <= client_access._REMEMBERED and access.allows("10.9.9.9")


def test_client_networks_accept_commas_and_reject_garbage():
    assert [str(n) for n in parse_networks(["10.0.0.5, 192.168.1.0/24", ""])] == ["10.0.0.5/32", "192.168.1.0/24"]
    with pytest.raises(ClientAccessError, match="failover_clients: 'example.com' is not an IP address or CIDR"):
        parse_networks(["example.com"])


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("", False), ("0.0.0.0", False), ("10.1.2.3", False)])
def test_listen_host_is_loopback(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("sni, connect_host, intercepted", [
    ("api.openai.com", "api.openai.com", True),
    ("chatgpt.com", None, True),
    ("CHATGPT.COM.", None, True),
    (None, "api.openai.com", True),  # no SNI: the CONNECT target decides
    ("pypi.org", "pypi.org", False),
    ("files.pythonhosted.org", None, False),
    ("github.com", "api.openai.com", False),  # the name the client asks TLS for wins
    ("models.corp.test", None, True),  # a pool base_url host
    (None, None, False),
])
def test_intercept_scope(sni, connect_host, intercepted):
    scope = InterceptScope(["https://models.corp.test:8443/v1"])
    assert scope.intercepts(sni, connect_host) is intercepted


def test_intercept_scope_follows_the_pool():
    pool = parse_pool({"base_urls": ["https://gw.example.test/v1"]}, "pool.yaml", {}, None)
    assert "gw.example.test" in InterceptScope(pool.gated_base_urls).hosts
    assert "gw.example.test" not in InterceptScope().hosts


def test_system_trust_locations():
    files, dirs = {SYSTEM_BUNDLES[1], "/custom/ca.pem"}, {"/custom/certs"}
    found = lambda env: system_locations(env, files.__contains__, dirs.__contains__)  # noqa: E731
    assert found({}) == (SYSTEM_BUNDLES[1], None)
    assert found({"SSL_CERT_FILE": "/custom/ca.pem", "SSL_CERT_DIR": "/custom/certs"}) == ("/custom/ca.pem", "/custom/certs")
    assert found({"SSL_CERT_FILE": "/missing.pem", "SSL_CERT_DIR": "/missing"}) == (None, None)
    assert system_locations({}, lambda p: False, lambda p: False) == (None, None)


def test_a_request_without_its_own_credential_never_gets_the_pool():
    pool = parse_pool({"credentials": [{"name": "spare", "api_key_env": "K"}]}, "pool.yaml", {"K": "sk-test-spare"}, None)
    health = Health()
    assert [c.name for c in make_plan(None, pool, health).candidates] == ["client"]
    assert [c.name for c in make_plan(None, pool, health, sticky="spare").candidates] == ["client"]
    own = auth_from_document({"OPENAI_API_KEY": "sk-test-own"}, "test")
    assert [c.name for c in make_plan(own, pool, health).candidates] == ["client", "spare"]


def test_gated_websocket_tls_trusts_the_system_store(tmp_path, monkeypatch):
    """The gate's own upstream sockets verify like every other attempt: a server whose CA is only in
    the system store (SSL_CERT_FILE standing in for it) verifies; without it, the handshake fails."""
    import socket
    import ssl
    import threading

    from harness import make_test_pki

    from codex_failover.ws.upstream import tls_context

    ca, server_pem = make_test_pki(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(server_pem)

    def handshake(client_ctx) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with client_ctx.wrap_socket(raw, server_hostname="localhost"):
                    return "verified"
        except ssl.SSLCertVerificationError as exc:
            return exc.verify_message
        finally:
            thread.join(5)
            listener.close()

    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert handshake(tls_context(False)) == "verified"
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "empty.pem"))
    (tmp_path / "empty.pem").write_text("")
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    assert "self-signed certificate in certificate chain" in handshake(tls_context(False))


def test_the_intercepted_hosts_follow_a_runtime_pool_change(tmp_path):
    from types import SimpleNamespace

    from mitmproxy.test import taddons

    from codex_failover.mitm.addon import FailoverAddon

    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("base_urls: [https://gw-a.example.test/v1]\n")
    second.write_text("base_urls: [https://gw-b.example.test/v1]\n")
    addon = FailoverAddon()

    def intercepted(host: str) -> bool:
        data = SimpleNamespace(ignore_connection=False, client_hello=SimpleNamespace(sni=host),
                               context=SimpleNamespace(server=SimpleNamespace(address=(host, 443)),
                                                       client=SimpleNamespace(proxy_mode=None)))
        addon.tls.tls_clienthello(data)
        return not data.ignore_connection

    with taddons.context(addon) as tctx:
        tctx.configure(addon, failover_config=str(first))
        assert intercepted("gw-a.example.test")
        assert not intercepted("gw-b.example.test")
        tctx.configure(addon, failover_config=str(second))
        assert intercepted("gw-b.example.test")
        assert not intercepted("gw-a.example.test")
        assert intercepted("api.openai.com")
        assert not intercepted("pypi.org")
        tctx.configure(addon, failover_intercept="all")
        assert intercepted("pypi.org")


def test_the_addons_own_upstream_tls_checks_as_mitmproxys_does():
    """A CA without an Authority Key Identifier (many TLS-inspecting corporate CAs) passes mitmproxy's
    upstream checks; Python 3.13's default strict checks refused it on the addon's own sockets."""
    import ssl

    from codex_failover.ws.upstream import tls_context
    assert not tls_context(False).verify_flags & getattr(ssl, "VERIFY_X509_STRICT", 0)
    assert tls_context(False).verify_mode == ssl.CERT_REQUIRED and tls_context(False).check_hostname
