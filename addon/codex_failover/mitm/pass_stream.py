"""A part of FailoverAddon (parts.py), the last: every flow the addon will not hold is streamed both
ways, as a plain proxy streams it (mitmproxy's `stream` on the request and the response, what its
`stream_large_bodies` sets for a large body), so a passed-through body costs the proxy a chunk's
memory, not the body's, and a passed-through event stream reaches its client as it comes.

A request may be held only once its body is read, so whether it can be held at all is decided at
`requestheaders`, from its head (`may_hold`: a model endpoint, a Codex-like request of the user's own
program, a body within failover_max_body as its Content-Length says): everything else streams. A
response is kept whole only for a flow the addon holds (its answer comes through the hop or the relay)
or whose answer a part reads (`reads_answer`: Codex's usage question, a reset credit's redemption).

docs/machine-proxy.md, "What passes through".
"""

from __future__ import annotations

import logging
from typing import Callable

from mitmproxy import http

from .attempt import ATTEMPT_TAG
from .client_hop import HOP_TAG
from .held_client import RELAY_TAG

log = logging.getLogger("codex_failover")


class PassStream:
    def __init__(self, may_hold: Callable[[http.HTTPFlow], bool], reads_answer: Callable[[http.HTTPFlow], bool]):
        self.may_hold = may_hold
        self.reads_answer = reads_answer

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.is_replay or ATTEMPT_TAG in flow.metadata or flow.request.stream or flow.response is not None:
            return
        if not self.may_hold(flow):
            flow.request.stream = True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or response.stream or response.status_code == 101 or flow.is_replay:
            return
        meta = flow.metadata
        if ATTEMPT_TAG in meta or HOP_TAG in meta or RELAY_TAG in meta or self.reads_answer(flow):
            return
        response.stream = True
