"""When a failed TLS handshake with a client is news: how a client that does not trust the proxy's CA
shows in the log. Pure: the clock is passed in; mitm/conn_trouble.py feeds it mitmproxy's
`tls_failed_client` / `tls_established_client` hooks and logs what it returns.

A single failed handshake says little: Codex, like any client, closes connections it opened before
their handshake ends, several a session, while everything works. So a failure is reported only when
it is a pattern: the same client address failed REPEAT handshakes for the same host without
completing one in between. A client that says so (a TLS alert: `unknown ca`, `bad certificate`,
`certificate unknown`) is reported at its first failure. Either way, once per client and host per
QUIET seconds. Bounded: at most MAX_KEPT client/host pairs are remembered, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

REPEAT = 3
QUIET = 600.0
MAX_KEPT = 256
DISTRUST = ("unknown ca", "bad certificate", "certificate unknown")
HOW = "give it mitmproxy's CA certificate (for Codex: CODEX_CA_CERTIFICATE; docs/machine-proxy.md)"


@dataclass
class _Pair:
    failures: int = 0
    reported_at: float | None = None
    last_error: str = ""


class HandshakeWatch:
    def __init__(self, repeat: int = REPEAT, quiet: float = QUIET, max_kept: int = MAX_KEPT) -> None:
        self.repeat, self.quiet, self.max_kept = repeat, quiet, max_kept
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()

    def established(self, client: str, host: str) -> None:
        """A handshake completed: the client trusts the proxy for that host."""
        pair = self._pairs.get((client, host))
        if pair is not None:
            pair.failures = 0

    def failed(self, client: str, host: str, error: str, now: float) -> str | None:
        """A handshake failed; the line to log, when it is news."""
        key = (client, host)
        pair = self._pairs.pop(key, None) or _Pair()
        self._pairs[key] = pair  # the most recent last
        while len(self._pairs) > self.max_kept:
            self._pairs.popitem(last=False)
        pair.failures += 1
        pair.last_error = error
        said = any(word in error.lower() for word in DISTRUST)
        if not said and pair.failures < self.repeat:
            return None
        if pair.reported_at is not None and now - pair.reported_at < self.quiet:
            return None
        pair.reported_at = now
        if said:
            return (f"client {client} does not trust the proxy's certificate for {host} (its TLS alert: {error}): "
                    f"{HOW}")
        return (f"client {client} failed {pair.failures} TLS handshakes in a row for {host} and completed none "
                f"(last: {error}): it may not trust the proxy's certificate; {HOW}")
