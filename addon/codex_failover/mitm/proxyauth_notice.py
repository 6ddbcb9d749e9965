"""One line for the first 407 each client address gets (mitmproxy's `--proxyauth` refused it): a
program without the proxy's credentials otherwise fails with no trace in the log (Codex says
"workspace routing discovery failed" 14 s later). A nested addon of FailoverAddon; the credentials a
client sent are never shown."""

from __future__ import annotations

import logging
from collections import OrderedDict

from mitmproxy import http

log = logging.getLogger("codex_failover")

MAX_ADDRESSES = 1024  # remembered at most (the oldest forgotten first: it may get its line again)


class ProxyAuthNotice:
    def __init__(self) -> None:
        self._told: OrderedDict[str, None] = OrderedDict()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and flow.response.status_code == 407:
            self.refused(flow)

    http_connect = requestheaders  # a CONNECT refused

    def refused(self, flow: http.HTTPFlow) -> None:
        peer = flow.client_conn.peername[0] if flow.client_conn.peername else "?"
        if peer in self._told:
            return
        self._told[peer] = None
        while len(self._told) > MAX_ADDRESSES:
            self._told.popitem(last=False)
        sent = "wrong" if "proxy-authorization" in flow.request.headers else "no"
        log.warning("codex-failover: client %s was answered 407 Proxy Authentication Required (--proxyauth): it sent "
                    "%s proxy credentials; give it the proxy URL with them (HTTPS_PROXY=http://USER:PASSWORD@HOST:PORT). "
                    "Further 407s to this address are not logged", peer, sent)
