"""The quiet default log (mitm/quiet_log.py): mitmproxy's per-connection INFO lines are lowered to
DEBUG, the dumper's flow echo is off unless the user asked for flows, and failover_verbose undoes
both. The end-to-end counts are in test_e2e_machine_proxy.py (a tunnel: 0 lines) and
test_codex_cli.py (a real Codex session: lines per model request)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from codex_failover.mitm.quiet_log import DUMPER_FILTER, QuietLog


class Options(SimpleNamespace):
    def keys(self):
        return set(vars(self))


def options(**kw) -> Options:
    return Options(**{"failover_verbose": False, "flow_detail": 1, "dumper_filter": None, **kw})


def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("mitmproxy.proxy.server", level, __file__, 1, message, None, None)


@pytest.mark.parametrize("message", ["client connect", "server connect 10.0.0.1:443", "client disconnect",
                                     "Streaming response from api.openai.com.", "HTTP/2 connection terminated"])
def test_connection_lines_go_to_debug(message):
    quiet = QuietLog()
    quiet.configure(options())
    r = record(message)
    assert quiet.filter(r) is True  # kept for the debug log, never dropped
    assert (r.levelno, r.levelname) == (logging.DEBUG, "DEBUG")


def test_failed_handshakes_and_hostless_connect_errors_go_to_debug_other_warnings_stay():
    """A failed client handshake alone is not news, at any level, and mitmproxy's connect error names
    no host: the addon's own lines say what is (conn_trouble.py, tests/test_conn_trouble.py)."""
    quiet = QuietLog()
    quiet.configure(options())
    warning = record("Client TLS handshake failed. The client does not trust the proxy's certificate", logging.WARNING)
    may = record("Client TLS handshake failed. The client may not trust the proxy's certificate for x (eof)",
                 logging.WARNING)
    info = record("Client TLS handshake failed. The client disconnected during the handshake.")
    unreachable = record("error establishing server connection: [Errno 111] Connection refused")
    for r, level in ((warning, logging.DEBUG), (may, logging.DEBUG), (info, logging.DEBUG),
                     (unreachable, logging.DEBUG), (record("HTTP/2 protocol error", logging.WARNING), logging.WARNING),
                     (record("boom", logging.ERROR), logging.ERROR)):
        quiet.filter(r)
        assert r.levelno == level


def test_verbose_leaves_every_line_alone():
    quiet = QuietLog()
    quiet.configure(options(failover_verbose=True))
    r = record("client connect")
    quiet.filter(r)
    assert r.levelno == logging.INFO


def test_the_flow_echo_is_off_by_default_and_back_with_verbose():
    quiet, opts = QuietLog(), options()
    quiet.configure(opts)
    assert (opts.flow_detail, opts.dumper_filter) == (0, DUMPER_FILTER)
    opts.failover_verbose = True
    quiet.configure(opts)
    assert (opts.flow_detail, opts.dumper_filter) == (1, None)


@pytest.mark.parametrize("asked", [{"flow_detail": 2}, {"flow_detail": 3}, {"dumper_filter": "~u /v1/"}])
def test_a_user_who_asked_for_flows_keeps_them(asked):
    opts = options(**asked)
    QuietLog().configure(opts)
    assert opts.flow_detail == asked.get("flow_detail", 1)
    if "dumper_filter" in asked:
        assert opts.dumper_filter == asked["dumper_filter"]
    else:  # the addon's own attempts stay out of the echo
        assert opts.dumper_filter == DUMPER_FILTER


def test_mitmweb_has_no_dumper_options():
    opts = Options(failover_verbose=False)
    QuietLog().configure(opts)  # nothing to set, no error
    assert not hasattr(opts, "flow_detail")


def test_a_debug_line_is_dropped_only_while_no_handler_takes_it():
    """Dropped before formatting when nothing would show it (mitmdump at its default verbosity);
    kept for a handler at debug level (the debug log, mitmweb's event view, a user's)."""
    from codex_failover.mitm.quiet_log import shown

    top = logging.Logger("quiet-test")
    below = logging.Logger("quiet-test.server")
    below.parent = top
    assert not shown(below, logging.DEBUG)
    info = logging.NullHandler()
    info.setLevel(logging.INFO)
    top.addHandler(info)
    assert not shown(below, logging.DEBUG) and shown(below, logging.INFO)
    top.addHandler(logging.NullHandler())  # level NOTSET: takes everything
    assert shown(below, logging.DEBUG)
    below.propagate = False
    assert not shown(below, logging.DEBUG)


class AddLog:
    def __init__(self):
        self.entries = []

    def add_log(self, entry):
        self.entries.append(entry.msg)


def test_the_add_log_event_is_made_only_while_an_addon_listens():
    """mitmproxy's LegacyLogEvents makes each record an `add_log` event for every addon (a loop
    wake-up and a dispatch each): skipped while no addon has `add_log`, made again at once when one
    is added; the other handlers get every record either way."""
    import asyncio

    from mitmproxy.log import LegacyLogEvents
    from mitmproxy.test import taddons

    async def go():
        with taddons.context() as tctx:
            handler = LegacyLogEvents(tctx.master)
            root = logging.getLogger()
            root.addHandler(handler)
            quiet = QuietLog()
            try:
                quiet.install()
                logger = logging.getLogger("codex_failover")
                with pytest.MonkeyPatch.context() as mp:
                    calls = []
                    real = tctx.master.event_loop.call_soon_threadsafe
                    mp.setattr(tctx.master.event_loop, "call_soon_threadsafe", lambda *a: (calls.append(a), real(*a)))
                    logger.warning("nobody listens")
                    assert calls == []
                    listener = AddLog()
                    tctx.master.addons.add(listener)
                    logger.warning("now one does")
                    await asyncio.sleep(0)
                    assert calls and listener.entries and all(m.endswith("now one does") for m in listener.entries)  # (the master has a handler too)
                quiet.uninstall()
                assert not handler.filters
            finally:
                quiet.uninstall()
                root.removeHandler(handler)

    asyncio.run(go())


@pytest.mark.parametrize("level, message, verbose, debug_handler, made", [
    (logging.INFO, "Streaming response from api.openai.com.", False, False, False),  # lowered, nobody shows debug
    (logging.INFO, "Streaming response from api.openai.com.", False, True, True),  # the debug log takes it
    (logging.INFO, "Streaming response from api.openai.com.", True, False, True),  # failover_verbose
    (logging.INFO, "error establishing server connection: refused", False, False, False),  # the addon's names the host
    (logging.WARNING, "HTTP/2 protocol error", False, False, True),
    (logging.DEBUG, "closing transports...", False, False, False),
])
def test_a_line_the_quiet_filter_would_drop_is_not_made(level, message, verbose, debug_handler, made):
    """`would_log` says what the filter would do with the record, before anyone makes it (the held
    stream's own lines ask: StreamWire.written); a logger's level counts too."""
    from codex_failover.mitm.quiet_log import would_log

    top, logger = logging.Logger("quiet-made"), logging.Logger("quiet-made.server")
    logger.parent = top
    info = logging.NullHandler()
    info.setLevel(logging.INFO)
    top.addHandler(info)
    if debug_handler:
        top.addHandler(logging.NullHandler())
    quiet = QuietLog()
    quiet.configure(options(failover_verbose=verbose))
    logger.addFilter(quiet)
    assert would_log(logger, level, message) is made
    r = logging.LogRecord(logger.name, level, __file__, 1, message, None, None)
    # The same answer as the filter, which looks the logger up by name: here, the test's own.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logging, "getLogger", lambda name=None: logger)
        assert quiet.filter(r) is made
    above = logging.Logger("quiet-made.server", logging.ERROR)
    above.parent = top
    above.addFilter(quiet)
    assert would_log(above, level, message) is False


def test_the_held_streams_lines_are_made_only_when_shown():
    """StreamWire.written hands the stream's held lines to the connection handler only when the
    quiet filter would let them through: a dropped line is never made."""
    from mitmproxy.proxy import commands

    from codex_failover.mitm.held_layer import SERVER_LOG, StreamWire

    class Handler:
        def __init__(self):
            self.lines = []

        def log(self, message, level):
            self.lines.append((message, level))

    quiet = QuietLog()
    quiet.configure(options())
    info = logging.NullHandler()
    info.setLevel(logging.INFO)  # the terminal at its default verbosity (pytest's own handlers left out)
    before = SERVER_LOG.level, SERVER_LOG.propagate, SERVER_LOG.filters
    SERVER_LOG.filters = [quiet]  # (an earlier test's addon may have left its own)
    SERVER_LOG.addHandler(info)
    SERVER_LOG.setLevel(logging.DEBUG)
    SERVER_LOG.propagate = False
    try:
        class Held:
            def first_written(self):
                pass

        wire = StreamWire(Handler(), stream_id=1, routes=[(None, None)], via=None,  # (no layer is asked)
                          target=(("api.openai.com", 443), True, None))
        wire.held = Held()
        wire.join_first()  # the head waits for the body: its lines are held
        assert wire.keep_back(commands.Log("Streaming response from api.openai.com.", logging.INFO))
        assert wire.keep_back(commands.Log("HTTP/2 protocol error", logging.WARNING))
        wire.written(final=True)
        assert wire.handler.lines == [("HTTP/2 protocol error", logging.WARNING)]
        quiet.configure(options(failover_verbose=True))
        wire.join_first()
        wire.keep_back(commands.Log("Streaming response from api.openai.com.", logging.INFO))
        wire.written(final=True)
        assert wire.handler.lines[-1] == ("Streaming response from api.openai.com.", logging.INFO)
    finally:
        SERVER_LOG.removeHandler(info)
        SERVER_LOG.setLevel(before[0])
        SERVER_LOG.propagate, SERVER_LOG.filters = before[1], before[2]


def test_a_line_is_made_when_another_filter_may_change_it():
    """Another filter on the logger (a user's, another addon's) may rewrite or raise a record before
    the quiet filter sees it: then the line is made and the filters decide, as for any other."""
    from codex_failover.mitm.quiet_log import would_log

    class Promote(logging.Filter):
        def filter(self, record):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True

    top, logger = logging.Logger("quiet-other"), logging.Logger("quiet-other.server")
    logger.parent = top
    quiet = QuietLog()
    quiet.configure(options())
    logger.addFilter(Promote())
    logger.addFilter(quiet)
    assert would_log(logger, logging.INFO, "Streaming response from api.openai.com.") is True
    alone = logging.Logger("quiet-other.alone")
    alone.parent = top
    alone.addFilter(quiet)
    assert would_log(alone, logging.INFO, "Streaming response from api.openai.com.") is False
    assert would_log(alone, logging.INFO, b"not a str") is False  # (as the filter reads it: str(msg))


def test_whether_an_addon_listens_is_asked_of_the_addon_tree_at_most_once_a_second():
    """quiet_log.listened walks mitmproxy's addon tree (the add_log filter asks it for every line): the
    answer holds for LISTENED_FOR seconds while the top-level addons stay the same; an addon nested
    deeper (a script's) is seen at the next walk."""
    from mitmproxy.test import taddons

    from codex_failover.mitm import quiet_log

    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    class Listener:
        def probe_hook(self, *_):
            pass

    class Tree:
        def __init__(self):
            self.addons = []

    clock = Clock()
    quiet_log._listened.clear()
    tree = Tree()
    with taddons.context(tree) as tctx:
        assert quiet_log.listened("probe_hook", clock) is False
        tree.addons.append(Listener())  # nested: the chain is the same
        clock.now += quiet_log.LISTENED_FOR / 2
        assert quiet_log.listened("probe_hook", clock) is False  # remembered
        clock.now += quiet_log.LISTENED_FOR
        assert quiet_log.listened("probe_hook", clock) is True  # asked again
        tree.addons.clear()
        tctx.master.addons.add(Listener())  # a top-level addon: seen at once
        assert quiet_log.listened("probe_hook", clock) is True
    quiet_log._listened.clear()
