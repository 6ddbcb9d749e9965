"""The addon's parts, called from the addon itself: FailoverAddon is one leaf addon, not a tree.

Why: CPU on every flow. mitmproxy finds an addon's handlers by walking its tree (`addons`) for each
hook's name, and follows every flow hook with a walk for `update`: FailoverAddon sits under the
script loader (ScriptLoader -> Script -> module -> addon), so with its seven parts as nested addons
each of a request's flow hooks walked seven more objects, for names most of them do not have
(docs/measurements.md, issue 27's fifth pass). Here each part's handlers for a hook are found once,
when the addon is made: the parts are the addon's own and do not change.

The calls are the ones mitmproxy made: the addon's own handler first (it has `request`, `configure`,
`running`, and calls its parts' there), then each part's in the parts' order; a handler that returns
an awaitable is awaited before the next one is called, as mitmproxy awaits it; an exception ends the
addon's turn at that handler, as mitmproxy's `safecall` ends a top-level addon's.
"""

from __future__ import annotations

import inspect

# The hooks the parts implement (tests/test_parts.py checks that no part has a hook missing here).
HOOKS = ("requestheaders", "responseheaders", "response", "error", "websocket_start", "client_disconnected",
         "tls_clienthello", "tls_start_server", "http_connect", "tls_established_client", "tls_failed_client",
         "server_connect_error", "server_connect", "server_connected", "server_disconnected", "client_connected")
OWN = ("configure", "running")  # the parts' hooks the addon's own handlers call (addon.py)


def each(handlers: tuple, arg):
    """Call `handlers` with `arg` in order; from the first that returns an awaitable on, an awaitable
    that awaits it and calls the rest (None when none did: a hook that waits for nothing costs no coroutine)."""
    for i, handler in enumerate(handlers):
        result = handler(arg)
        if result is not None and inspect.isawaitable(result):
            return _rest(result, handlers[i + 1:], arg)
    return None


async def _rest(pending, handlers: tuple, arg) -> None:
    await pending
    for handler in handlers:
        result = handler(arg)
        if result is not None and inspect.isawaitable(result):
            await result


class PartHooks:
    """FailoverAddon's hooks that only its parts implement (`_wire` them first)."""

    parts: tuple
    _on: dict[str, tuple]

    def _wire(self, parts: list) -> None:
        self.parts = tuple(parts)
        self._on = {name: tuple(getattr(part, name) for part in parts if callable(getattr(part, name, None)))
                    for name in HOOKS}

    def configure_parts(self, updated: set[str]) -> None:
        """The parts' own `configure` (OWN: the addon's handler calls this), in the parts' order."""
        for part in self.parts:
            if callable(getattr(part, "configure", None)):
                part.configure(updated)

    def requestheaders(self, flow):
        return each(self._on["requestheaders"], flow)

    def responseheaders(self, flow):
        return each(self._on["responseheaders"], flow)

    def response(self, flow):
        return each(self._on["response"], flow)

    def error(self, flow):
        return each(self._on["error"], flow)

    def websocket_start(self, flow):
        return each(self._on["websocket_start"], flow)

    def client_disconnected(self, client):
        return each(self._on["client_disconnected"], client)

    def tls_clienthello(self, data):
        return each(self._on["tls_clienthello"], data)

    def tls_start_server(self, tls_start):
        return each(self._on["tls_start_server"], tls_start)

    def http_connect(self, flow):
        return each(self._on["http_connect"], flow)

    def tls_established_client(self, data):
        return each(self._on["tls_established_client"], data)

    def tls_failed_client(self, data):
        return each(self._on["tls_failed_client"], data)

    def server_connect_error(self, data):
        return each(self._on["server_connect_error"], data)

    def client_connected(self, client):
        return each(self._on["client_connected"], client)

    def server_connect(self, data):
        return each(self._on["server_connect"], data)

    def server_connected(self, data):
        return each(self._on["server_connected"], data)

    def server_disconnected(self, data):
        return each(self._on["server_disconnected"], data)
