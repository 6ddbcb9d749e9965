"""A nested addon of FailoverAddon, the last: every flow the addon will not hold goes on as a plain
proxy sends it: a large body, one of unsaid size and an event stream are streamed (mitmproxy's
`stream` on the request and the response, what its `stream_large_bodies` sets for a large body), a
small one read whole (core/pass_through.py decides), so a passed-through body costs the proxy at most
a chunk or 1 MiB of memory, never the whole, a passed-through event stream reaches its client as it
comes, and the user's own addons (map_remote, modify_body) still see a small request before it is sent.

A request may be held only once its body is read, so whether it can be held at all is decided at
`requestheaders`, from its head (`may_hold`: a model endpoint, a Codex-like request of the user's own
program, a body within failover_max_body as its Content-Length says): everything else streams. A
response is kept whole only for a flow the addon holds (its answer comes through the hop or the relay)
or whose answer a part reads (`reads_answer`: Codex's usage question, a reset credit's redemption).

docs/machine-proxy.md, "What passes through".
"""

from __future__ import annotations

import logging

from mitmproxy import http

from ..core.auth import auth_from_headers
from ..core.codex_request import is_websocket_upgrade
from ..core.pass_through import ANSWERED_BODY, size_of, small_enough, streams
from . import held_layer
from .attempt import ATTEMPT_TAG, Capture
from .held_client import RELAY_TAG
from .held_stream import HOP_TAG
from .usage_answer import UsageAnswer

log = logging.getLogger("codex_failover")


STATUS_HOST = "codex-failover.status"


class PassStream:
    def __init__(self, owner, usage_answer: UsageAnswer):
        self.owner = owner  # the FailoverAddon: its matcher, clients, boundary, max_body, parts
        self.usage_answer = usage_answer

    def may_hold(self, flow: http.HTTPFlow) -> bool:
        """Can this request, by its head, be one the addon answers or holds? A held request's body is
        read whole, so it must say its size (Content-Length) and be within failover_max_body."""
        req, owner = flow.request, self.owner
        if req.host == STATUS_HOST:
            return True
        if not owner.matcher.matches(req.host, req.port, req.path):
            return False
        if not owner.clients.allows(flow.client_conn.peername[0] if flow.client_conn.peername else None):
            return True  # answered 403 by the request hook
        auth = auth_from_headers(req.headers)
        if auth is None or owner.boundary.passed_by(flow, auth):
            return False
        if is_websocket_upgrade(req.method, req.headers):
            return True
        if req.method != "POST":
            return False
        size = size_of(req.headers.get("content-length"))
        if size is None:
            log.warning("codex-failover: a model request body without a Content-Length (it could be over "
                        "failover_max_body): passed through untouched, without failover")
            return False
        if size > owner.max_body:
            log.warning("codex-failover: a %s-byte request body is over failover_max_body (%d): passed through "
                        "untouched, without failover", size, owner.max_body)
            return False
        return True

    def reads_answer(self, flow: http.HTTPFlow) -> bool:
        """A passed-through flow whose answer a part reads whole (a usage question, a credit's redemption)."""
        return self.usage_answer.reads_answer_of(flow) or self.owner.back.reads_answer_of(flow)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.is_replay or ATTEMPT_TAG in flow.metadata or flow.request.stream or flow.response is not None:
            return
        req = flow.request
        if self.answered_here(flow) and not small_enough(req.headers.get("content-length"),
                                                          req.headers.get("transfer-encoding")):
            log.warning("codex-failover: a request to %s from %s with a body over %d KiB (or of unsaid size): "
                        "closed unread (the addon answers it itself)", req.host,
                        flow.client_conn.peername[0] if flow.client_conn.peername else "?", ANSWERED_BODY >> 10)
            flow.kill()
            return
        # Read whole (core/pass_through.py) only a small body of the user's own program: another user's
        # streams whatever its size, so many small bodies cannot add up in the proxy.
        if not self.may_hold(flow) and (streams(req.headers.get("content-length"))
                                        or not self.owner.boundary.is_own(flow.client_conn)):
            flow.request.stream = Capture()  # streamed on, its first 64 KiB kept for mitmweb

    def answered_here(self, flow: http.HTTPFlow) -> bool:
        """A request the addon answers itself, never sent on: the status page's, or a model request from a
        client failover_clients refuses (answered 403)."""
        req, owner = flow.request, self.owner
        if req.host == STATUS_HOST:
            return True
        return owner.matcher.matches(req.host, req.port, req.path) and not owner.clients.allows(
            flow.client_conn.peername[0] if flow.client_conn.peername else None)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or response.stream or response.status_code == 101 or flow.is_replay:
            return
        meta = flow.metadata
        if ATTEMPT_TAG in meta or HOP_TAG in meta or RELAY_TAG in meta or self.reads_answer(flow):
            return
        if streams(response.headers.get("content-length"), response.headers.get("content-type")):
            response.stream = Capture()

    def response(self, flow: http.HTTPFlow) -> None:
        """A streamed message keeps what it captured; any other left without content (a record of the
        addon's, a stream cut short) gets an empty one: mitmweb's content view cannot serve none."""
        for message in (flow.request, flow.response):
            if message is not None and message.raw_content is None:
                stream = message.stream
                if isinstance(stream, Capture):
                    stream.keep_on(message)  # (sets the content of whichever message it is given)
                else:
                    message.raw_content = b""

    error = response

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        """A WebSocket the addon does not gate: each message bounded by failover_max_body while
        mitmproxy gathers it (it has no streaming for messages)."""
        meta = flow.metadata
        if ATTEMPT_TAG in meta or HOP_TAG in meta or RELAY_TAG in meta:
            return
        cap = self.owner.max_body

        def over() -> None:
            log.warning("codex-failover: a passed-through WebSocket message grew past failover_max_body (%d): "
                        "its connection closed (%s)", cap, flow.request.pretty_url)

        held_layer.bound_websocket(flow, cap, over)
