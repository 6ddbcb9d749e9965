"""TLS for the machine-wide proxy, as a nested addon of FailoverAddon: which client connections are
decrypted (scoped interception, docs/machine-proxy.md) and what upstream certificates are trusted
(certifi plus the system store). The mitmproxy facts: docs/mitmproxy-12.3.1-replay-notes.md §8."""

from __future__ import annotations

import weakref

import certifi
from mitmproxy import ctx, tls

from ..core.intercept_scope import ALL, InterceptScope
from ..net.trust import extend_openssl_context


class TlsScope:
    def __init__(self) -> None:
        self.scope = InterceptScope()  # replaced when the pool file is (re)loaded
        self._trusted: weakref.WeakSet = weakref.WeakSet()  # server TLS contexts given the system store

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        """Scoped interception: only the model endpoints are decrypted; every other TLS connection
        is tunnelled as it is. A user's --allow-hosts decides alone; --ignore-hosts acted earlier."""
        if data.ignore_connection or ctx.options.failover_intercept == ALL or ctx.options.allow_hosts:
            return
        if getattr(data.context.client.proxy_mode, "type_name", None) == "reverse":  # its upstream is fixed
            return  # the operator named the one target
        address = data.context.server.address
        if not self.scope.intercepts(data.client_hello.sni, address[0] if address else None):
            data.ignore_connection = True

    def tls_start_server(self, tls_start: tls.TlsData) -> None:
        """Upstream verification trusts certifi and the machine's store, plus mitmproxy's CA options.
        Scripts run before mitmproxy's TlsConfig, which leaves a connection an addon has set up
        alone: so TlsConfig builds it now (its cached context), and each context is extended once."""
        if tls_start.ssl_conn is None and not tls_start.is_dtls:
            tlsconfig = ctx.master.addons.get("tlsconfig")
            if tlsconfig is not None:
                tlsconfig.tls_start_server(tls_start)
        conn = tls_start.ssl_conn
        if conn is None or ctx.options.ssl_insecure:
            return
        context = conn.get_context()
        if context in self._trusted:
            return
        if ctx.options.ssl_verify_upstream_trusted_ca or ctx.options.ssl_verify_upstream_trusted_confdir:
            extend_openssl_context(context, (certifi.where(), None))  # mitmproxy loads certifi only without them
        extend_openssl_context(context)
        self._trusted.add(context)
