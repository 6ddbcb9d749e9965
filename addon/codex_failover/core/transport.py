"""What a failed upstream connection means for replay safety. Pure: reads mitmproxy's error text.

Only a failure proven to happen before any request byte left may be replayed elsewhere
(docs/architecture.md#replay-safety). Host-wide network loss is nobody's fault; TLS verification failures fail closed.
"""

from __future__ import annotations

from .vocabulary import AMBIGUOUS, HOST_NETWORK, NOT_PROCESSED, PRE_DISPATCH, TLS_FAILED

# What each class means: core/vocabulary.py.
_PRE_DISPATCH = ("connect call failed", "connection refused", "errno 111", "connect timeout", "timed out connecting",
                 "refused http connect request", "error connecting to")
_HOST_NETWORK = ("name or service not known", "nodename nor servname", "getaddrinfo", "temporary failure in name resolution",
                 "network is unreachable", "no address associated", "errno -2", "errno -3", "errno 101")
_TLS = ("certificate verify failed", "tls handshake", "ssl", "certificate")


def classify_connection_error(message: str, response_started: bool) -> str:
    if response_started:
        return AMBIGUOUS
    text = message.lower()
    if "never processed this stream" in text:  # an HTTP/2 GOAWAY's word (mitm/warm_conn.py)
        return NOT_PROCESSED
    if any(s in text for s in _HOST_NETWORK):
        return HOST_NETWORK
    if any(s in text for s in _TLS):
        return TLS_FAILED
    if any(s in text for s in _PRE_DISPATCH):
        return PRE_DISPATCH
    return AMBIGUOUS
