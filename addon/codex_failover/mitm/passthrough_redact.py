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

from .attempt import ATTEMPT_TAG, hide_secrets, secrets_in


class PassThroughRedaction:
    def __init__(self, is_model_host: Callable[[str], bool]):
        self.is_model_host = is_model_host

    def _redact(self, flow: http.HTTPFlow) -> None:
        if ATTEMPT_TAG in flow.metadata:
            return  # an attempt redacts itself (attempt.py), around its own send
        request = flow.request
        if secrets_in(request.headers) and self.is_model_host(request.pretty_host):
            hide_secrets(request)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._redact(flow)
