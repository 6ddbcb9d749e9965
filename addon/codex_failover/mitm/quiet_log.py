"""A quiet default log: the addon's own lines, not mitmproxy's chatter about the addon's plumbing.

Each attempt is a mitmproxy replay and each held flow is answered through a hop (in process, or the
loopback relay); mitmproxy logs INFO lines for them (`[replay] server connect`, `server connect
127.0.0.1:<relay>`, `Streaming response from <host>.`, the dumper's echo of every replayed flow),
which drown the one line per attempt. Those are lowered to DEBUG (the event log at debug verbosity
still has them); warnings and errors are untouched. `failover_verbose` turns this off.
"""

from __future__ import annotations

import logging
from typing import Callable

SERVER_LOGGER = "mitmproxy.proxy.server"  # connection events of every client connection
DUMPER_FILTER = "!~replayq"  # the dumper's echo: every flow but replayed requests (our attempts)


def lowered(record: logging.LogRecord) -> None:
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"


class QuietLog(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.verbose = False
        self._relay_port: Callable[[], int | None] = lambda: None
        self._held_clients: dict[tuple, int] = {}  # client peername -> held flows streaming now (their hop or relay hop)
        self._set_dumper_filter = False

    # -- setup -------------------------------------------------------------------------------

    def configure(self, options) -> None:
        self.verbose = bool(options.failover_verbose)
        if "dumper_filter" not in options.keys():  # mitmweb and mitmproxy have no dumper
            return
        if not self.verbose and options.dumper_filter is None:
            self._set_dumper_filter = True
            options.dumper_filter = DUMPER_FILTER
        elif self.verbose and self._set_dumper_filter and options.dumper_filter == DUMPER_FILTER:
            self._set_dumper_filter = False
            options.dumper_filter = None

    def install(self, relay_port: Callable[[], int | None]) -> None:
        self._relay_port = relay_port
        logging.getLogger(SERVER_LOGGER).addFilter(self)

    def uninstall(self) -> None:
        logging.getLogger(SERVER_LOGGER).removeFilter(self)

    # -- held flows (answered in process, or through the relay) ------------------------------------

    def held_client(self, peername) -> None:
        self._held_clients[peername] = self._held_clients.get(peername, 0) + 1

    def held_client_done(self, peername) -> None:
        left = self._held_clients.get(peername, 0) - 1
        if left > 0:
            self._held_clients[peername] = left
        else:
            self._held_clients.pop(peername, None)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.levelno > logging.INFO:
            return True
        message = record.getMessage()
        port = self._relay_port()
        if port and message.endswith(f" 127.0.0.1:{port}"):  # server connect/disconnect of a relay hop
            lowered(record)
        elif message.startswith("Streaming response from") and getattr(record, "client", None) in self._held_clients:
            lowered(record)
        return True


def replay_level(level: int, verbose: bool) -> int:
    """The level for a line mitmproxy logs about one of the addon's attempts."""
    return logging.DEBUG if level == logging.INFO and not verbose else level
