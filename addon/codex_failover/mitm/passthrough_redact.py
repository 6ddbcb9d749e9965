"""A nested addon of FailoverAddon: model hosts' flows the addon passes through untouched
(`/backend-api/wham/*`, `/backend-api/codex/models`, analytics, a request without a stream) keep
no credential once their request has left.

Codex sends its `authorization: Bearer …` and `chatgpt-account-id` on every request to
`chatgpt.com` and `api.openai.com`, not only on the model requests the addon holds (whose flows,
and every attempt, are redacted from the start). Those other requests go upstream as mitmproxy
sends them, so their headers can only be replaced after they left: at `responseheaders`, and again
at `response` / `error` (a flow that never got a response), before mitmweb's view and `-w` see the
flow end. While such a request waits for its response, mitmweb's in-memory flow still has them.
Other hosts' flows (under `failover_intercept=all`) are left as mitmproxy keeps them.
"""

from __future__ import annotations

from typing import Callable

from mitmproxy import http

from .attempt import ATTEMPT_TAG, PLACEHOLDER, SECRET_HEADERS, hide_secrets

_SECRET_NAMES = frozenset(name.encode() for name in SECRET_HEADERS)
_HIDDEN = PLACEHOLDER.encode()


def _bare(headers: http.Headers) -> bool:
    """Does a secret header still hold a value of its own? A held model request's flow was given
    placeholders from the start (request_run.py): its hooks here then cost one pass over its
    headers, not the host's parsing (9 us) and the headers set again."""
    return any(value != _HIDDEN and name.lower() in _SECRET_NAMES for name, value in headers.fields)


class PassThroughRedaction:
    def __init__(self, is_model_host: Callable[[str], bool]):
        self.is_model_host = is_model_host

    def _redact(self, flow: http.HTTPFlow) -> None:
        if ATTEMPT_TAG in flow.metadata:
            return  # an attempt redacts itself (attempt.py), around its own send
        request = flow.request
        if _bare(request.headers) and self.is_model_host(request.pretty_host):
            hide_secrets(request)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)
