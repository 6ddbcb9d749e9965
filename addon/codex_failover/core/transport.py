"""What a failed upstream connection means for replay safety. Pure: reads mitmproxy's error text.

Only a failure proven to happen before any request byte left may be replayed elsewhere
(docs/architecture.md#replay-safety). Host-wide network loss is nobody's fault; TLS verification failures fail closed.
"""

from __future__ import annotations

PRE_DISPATCH = "pre_dispatch"  # connection refused / timed out while connecting
HOST_NETWORK = "host_network"  # name resolution failed, network unreachable
TLS_FAILED = "tls_failed"  # certificate verification or handshake failure
AMBIGUOUS = "ambiguous"  # the request may have been sent
ROUTE_DOWN = "route_down"  # every endpoint of a credential's route failed before dispatch
# After the request left: its response never came, or never completed (the request may have been used).
RESPONSE_TIMEOUT = "response_timeout"
INCOMPLETE_RESPONSE = "incomplete_response"
# A WebSocket upgrade (no conversation rides on it): answered with a non-101 that is not a known
# rejection, or failed during the handshake.
UPGRADE_REFUSED = "upgrade_refused"
HANDSHAKE_FAILED = "handshake_failed"

_PRE_DISPATCH = ("connect call failed", "connection refused", "errno 111", "connect timeout", "timed out connecting",
                 "refused http connect request", "error connecting to")
_HOST_NETWORK = ("name or service not known", "nodename nor servname", "getaddrinfo", "temporary failure in name resolution",
                 "network is unreachable", "no address associated", "errno -2", "errno -3", "errno 101")
_TLS = ("certificate verify failed", "tls handshake", "ssl", "certificate")


def classify_connection_error(message: str, response_started: bool) -> str:
    if response_started:
        return AMBIGUOUS
    text = message.lower()
    if any(s in text for s in _HOST_NETWORK):
        return HOST_NETWORK
    if any(s in text for s in _TLS):
        return TLS_FAILED
    if any(s in text for s in _PRE_DISPATCH):
        return PRE_DISPATCH
    return AMBIGUOUS
