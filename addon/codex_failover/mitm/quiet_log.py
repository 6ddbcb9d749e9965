"""A quiet default log: the addon's own lines, mitmproxy's warnings and errors, and nothing per
connection or per message.

Run all day as a machine's proxy, mitmproxy's INFO lines are about traffic nobody asked to see:
`client connect` / `server connect` / disconnect for every tunnelled connection of every program,
the same for each attempt and relay hop of the addon, `Streaming response from …`, and mitmdump's
echo of every flow (every WebSocket message under `failover_websocket=gate`, and the
` << stream reset by client (CANCEL)` Codex causes at the end of each stream). Left alone, a Codex
session logs some 24 lines per model request, one of them the addon's.

Two public knobs keep them out, and both are undone by `failover_verbose=true`:

- every INFO record of mitmproxy's connection loggers is lowered to DEBUG (the event log at
  `termlog_verbosity=debug`, or mitmweb's debug view, still has them), and so is every failed client
  TLS handshake, whatever its level: a client closing a connection it opened before its handshake
  ended (Codex does, several times a session) is not news. The addon says instead what is
  (conn_trouble.py): a client that keeps failing its handshakes, or says it does not trust the CA
  (how a missing CA shows), and an upstream the proxy could not connect to, with its host (how a
  broken egress shows). With no handler that takes debug lines (mitmdump at its default
  verbosity), such a line is dropped before it is formatted.
- mitmdump's flow echo is off (`flow_detail=0`) while `flow_detail` and `dumper_filter` are at their
  defaults: a user who sets either (or `-v`, which sets `flow_detail=2`) asked for flows, and then
  only the addon's own attempts are left out of the echo (`dumper_filter=!~replayq`).

And one that costs nothing to keep: mitmproxy's `LegacyLogEvents` handler (on the root logger) turns
every record it gets into an `add_log` event for the addons, a deprecated hook: it formats the
record, wakes the event loop through its self-pipe, and sends the event to every addon through
mitmproxy's dispatch (some 60-90 us of CPU a record with mitmdump's 36 addons). With no addon that
implements `add_log` (mitmdump has none), that handler is skipped (`NoAddLogListener`), asked again
at every record; any other handler (the terminal's, mitmweb's event log, a user's) gets every record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mitmproxy import ctx
from mitmproxy.addonmanager import traverse
from mitmproxy.log import LegacyLogEvents

# Everything a connection's layers log (connects, HTTP/2 resets, streaming) goes through the first;
# replays started with mitmproxy's own client playback log through the second.
CONNECTION_LOGGERS = ("mitmproxy.proxy.server", "mitmproxy.addons.clientplayback")
# Lowered to DEBUG at any level: a failed client handshake alone is not news (conn_trouble.py says when it is).
HANDSHAKE = "Client TLS handshake failed"
# (mitmproxy's `error establishing server connection: …`, an INFO line, names no host: lowered as the
# others, conn_trouble.py logs one that does.)
DUMPER_FILTER = "!~replayq"  # the dumper's echo: every flow but replayed requests (our attempts)
DEFAULT_FLOW_DETAIL = 1  # mitmdump's default


def lowered(record: logging.LogRecord) -> None:
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"


class QuietLog(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.verbose = False
        self._set_dumper_filter = False
        self._set_flow_detail = False

    # -- setup -------------------------------------------------------------------------------

    def configure(self, options) -> None:
        self.verbose = bool(options.failover_verbose)
        if "dumper_filter" not in options.keys():  # mitmweb and mitmproxy have no dumper
            return
        user_asked_for_flows = options.dumper_filter is not None or options.flow_detail != DEFAULT_FLOW_DETAIL
        if not self.verbose:
            if not user_asked_for_flows:
                self._set_flow_detail = True
                options.flow_detail = 0
            if options.dumper_filter is None:
                self._set_dumper_filter = True
                options.dumper_filter = DUMPER_FILTER
            return
        if self._set_flow_detail and options.flow_detail == 0:
            options.flow_detail = DEFAULT_FLOW_DETAIL
        if self._set_dumper_filter and options.dumper_filter == DUMPER_FILTER:
            options.dumper_filter = None
        self._set_flow_detail = self._set_dumper_filter = False

    def install(self) -> None:
        for name in CONNECTION_LOGGERS:
            logging.getLogger(name).addFilter(self)
        for handler in _legacy_handlers():
            if not any(isinstance(f, NoAddLogListener) for f in handler.filters):
                handler.addFilter(NoAddLogListener())

    def uninstall(self) -> None:
        for name in CONNECTION_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        for handler in _legacy_handlers():
            for f in [f for f in handler.filters if isinstance(f, NoAddLogListener)]:
                handler.removeFilter(f)

    def filter(self, record: logging.LogRecord) -> bool:
        if self._level(record.levelno, record.msg) != record.levelno:
            lowered(record)
        return self.passes(logging.getLogger(record.name), record.levelno, record.msg)

    def passes(self, logger: logging.Logger, level: int, message: object) -> bool:
        """What `filter` says of a record of `logger` at `level` with text `message` (asked before
        the record is made: `would_log`). A debug line nobody takes is dropped, before any handler
        formats it: mitmproxy's LegacyLogEvents formats every record and sends it to every addon (its
        own slow dispatch, a wake-up of the loop) for addons' `add_log`, which mitmdump has none of."""
        level = self._level(level, message)
        return self.verbose or level != logging.DEBUG or shown(logger, logging.DEBUG)

    def _level(self, level: int, message: object) -> int:
        """The level a record has once past this filter: a connection's INFO line is DEBUG."""
        if self.verbose or level not in (logging.INFO, logging.WARNING):
            return level
        text = str(message)
        if level == logging.INFO or text.startswith(HANDSHAKE):
            return logging.DEBUG
        return level


def would_log(logger: logging.Logger, level: int, message: object) -> bool:
    """Would a line get past `logger`'s level and its quiet filters? False: making the record (its
    caller looked up, the record built, then dropped by `QuietLog.filter`) can be skipped. Any other
    filter on the logger (a user's, another addon's) may change the record: then it is made, and the
    filters decide as always. The held stream's own lines (`StreamWire.written`) ask, one a request."""
    if not logger.isEnabledFor(level):
        return False
    for f in logger.filters:
        if not isinstance(f, QuietLog):
            return True
        if not f.passes(logger, level, message):
            return False
    return True


def shown(logger: logging.Logger, level: int) -> bool:
    """Would a handler take a record of `logger` at `level` (the debug log, mitmweb's event view, a
    user's)? mitmproxy's LegacyLogEvents counts only when some addon has an `add_log` hook."""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if level >= handler.level and (not isinstance(handler, LegacyLogEvents) or _add_log_wanted()):
                return True
        current = current.parent if current.propagate else None
    return False


class NoAddLogListener(logging.Filter):
    """On mitmproxy's `add_log` handler: a record goes to it only when some addon has `add_log`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _add_log_wanted()


def _legacy_handlers() -> list[LegacyLogEvents]:
    return [h for h in logging.getLogger().handlers if isinstance(h, LegacyLogEvents)]


def _add_log_wanted() -> bool:
    return listened("add_log")


LISTENED_FOR = 1.0  # seconds an answer of `listened` holds while the addons stay the same
_listened: dict[str, tuple[bool, float, tuple[int, ...]]] = {}  # hook -> (some addon takes it, when, the chain asked)


def listened(hook: str, clock: Callable[[], float] = time.monotonic) -> bool:
    """Does some addon implement `hook`? Asked before an event that no addon may take is sent (mitmproxy's
    dispatch of one costs a coroutine or a context manager for each of mitmdump's ~36 addons, and the
    `add_log` event is asked for every log line). The walk of the addon tree it takes is done at most
    once a second per hook while the top-level addons stay the same (one added or removed is seen at
    once; a script's own addons reloaded, within a second). An addon whose tree cannot be read might
    implement it: True."""
    try:
        chain = ctx.master.addons.chain
    except AttributeError:  # no master (unit tests): not remembered
        return True
    now, ids = clock(), tuple(map(id, chain))
    known = _listened.get(hook)
    if known is not None and now - known[1] < LISTENED_FOR and known[2] == ids:
        return known[0]
    try:
        found = any(getattr(addon, hook, None) for addon in traverse(chain))
    except Exception:  # noqa: BLE001 - mitmproxy's dispatch logs that addon's error when it sends the event
        found = True
    _listened[hook] = (found, now, ids)
    return found


def replay_level(level: int, verbose: bool) -> int:
    """The level for a line mitmproxy logs about one of the addon's attempts."""
    return logging.DEBUG if level == logging.INFO and not verbose else level
