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


def test_warnings_the_untrusted_ca_and_an_unreachable_upstream_keep_their_level():
    quiet = QuietLog()
    quiet.configure(options())
    warning = record("Client TLS handshake failed. The client does not trust the proxy's certificate", logging.WARNING)
    info = record("Client TLS handshake failed. The client disconnected during the handshake.")
    unreachable = record("error establishing server connection: [Errno 111] Connection refused")
    for r, level in ((warning, logging.WARNING), (info, logging.INFO), (unreachable, logging.INFO),
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
