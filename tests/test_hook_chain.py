"""hook_chain runs a hook as mitmproxy's AddonManager does: the same calls in the same order, the same
errors logged, AddonHalt and OptionsError as there; the update only when an addon listens."""

import asyncio
import logging
import sys
import types

import pytest
from mitmproxy import exceptions
from mitmproxy.addons.script import ScriptLoader
from mitmproxy.hooks import UpdateHook
from mitmproxy.proxy.layers.http import HttpRequestHook
from mitmproxy.test import taddons, tflow

from codex_failover.mitm import hook_chain


class Rec:
    def __init__(self, name, calls, children=(), does=None):
        self.name, self.calls, self.does = name, calls, does
        if children:
            self.addons = list(children)

    def request(self, flow):
        self.calls.append(self.name)
        if self.does is not None:
            raise self.does


class AsyncRec(Rec):
    async def request(self, flow):
        self.calls.append(self.name)


class Odd:
    def __init__(self, value):
        self.request, self.name = value, f"odd-{id(self)}"

    def __repr__(self):
        return "Odd"


def chain(calls, halt=False):
    """Addons covering every path: nested, async, raising mid-addon, non-callable, a module."""
    return [
        Rec("a", calls),
        Rec("b", calls, [AsyncRec("b1", calls), Rec("b2", calls, does=ValueError("boom")), Rec("b3", calls)]),
        Odd(types),  # a module named like the hook: skipped
        Rec("c", calls, [Odd(5), Rec("c1", calls)]),  # not callable: an error, c1 not reached
        Rec("d", calls, does=exceptions.AddonHalt() if halt else None),
        Rec("e", calls),
    ]


async def run(impl, halt, caplog):
    calls: list[str] = []
    with taddons.context(*chain(calls, halt)) as tctx:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            hook = HttpRequestHook(tflow.tflow())
            if impl == "mitmproxy":
                await tctx.master.addons.trigger_event(hook)
            else:
                await hook_chain.trigger(tctx.master.addons, hook)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return calls, errors


@pytest.mark.parametrize("halt", [False, True])
def test_trigger_calls_and_logs_what_mitmproxy_does(caplog, halt):
    async def both():
        return await run("ours", halt, caplog), await run("mitmproxy", halt, caplog)

    mine, theirs = asyncio.run(both())
    assert mine == theirs
    calls, errors = mine
    assert calls == ["a", "b", "b1", "b2", "c", "d"] + ([] if halt else ["e"])
    assert errors[0] == "Addon error: boom"
    assert errors[1].startswith("Addon error: Addon handler request (") and errors[1].endswith("not callable")


def test_an_options_error_propagates_as_in_mitmproxy():
    calls: list[str] = []

    async def both():
        with taddons.context(Rec("a", calls, does=exceptions.OptionsError("bad option")), Rec("b", calls)) as tctx:
            for trigger in (tctx.master.addons.trigger_event, lambda h: hook_chain.trigger(tctx.master.addons, h)):
                with pytest.raises(exceptions.OptionsError):
                    await trigger(HttpRequestHook(tflow.tflow()))

    asyncio.run(both())
    assert calls == ["a", "a"]


class Listener:
    def __init__(self):
        self.updates = []

    def update(self, flows):
        self.updates.append(flows)


def test_lifecycle_sends_the_update_only_when_an_addon_listens():
    calls: list[str] = []
    listener = Listener()
    flow = tflow.tflow()

    async def go():
        with taddons.context(Rec("a", calls)) as tctx:
            assert not hook_chain.listens(tctx.master.addons, "update")
            await hook_chain.lifecycle(tctx.master.addons, HttpRequestHook(flow))
            tctx.master.addons.add(listener)
            assert hook_chain.listens(tctx.master.addons, "update")
            await hook_chain.lifecycle(tctx.master.addons, HttpRequestHook(flow))
            await hook_chain.lifecycle(tctx.master.addons, UpdateHook([flow]))  # not a flow: no second update

    asyncio.run(go())
    assert calls == ["a", "a"]
    assert listener.updates == [[flow], [flow]]


# -- a script reloaded while an earlier handler awaits (mitmproxy walks an addon tree lazily) --------

A = """
import hookrec
async def request(flow):
    hookrec.calls.append("a")
    await hookrec.gate.wait()
"""
B = """
import hookrec
VERSION = {v!r}
def request(flow):
    hookrec.calls.append("b" + VERSION)
def done():
    hookrec.calls.append("done" + VERSION)
"""


async def run_with_reload(impl, tmp_path):
    rec = types.ModuleType("hookrec")
    rec.calls, rec.gate = [], asyncio.Event()
    sys.modules["hookrec"] = rec
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(A)
    b.write_text(B.format(v="old"))
    sl = ScriptLoader()
    with taddons.context(sl) as tctx:
        tctx.configure(sl, scripts=[str(a), str(b)])
        await asyncio.sleep(0.05)  # the scripts' watchers load them
        script_b = sl.addons[1]
        hook = HttpRequestHook(tflow.tflow())
        if impl == "mitmproxy":
            task = asyncio.create_task(tctx.master.addons.trigger_event(hook))
        else:
            task = asyncio.create_task(hook_chain.trigger(tctx.master.addons, hook))
        await asyncio.sleep(0.01)  # a's hook awaits
        b.write_text(B.format(v="new"))
        script_b.loadscript()  # what its watcher does when the file changed
        rec.gate.set()
        await task
        for s in sl.addons:
            if s.reloadtask:
                s.reloadtask.cancel()
    return rec.calls


@pytest.mark.parametrize("impl", ["mitmproxy", "hook_chain"])
def test_a_script_reloaded_while_an_earlier_hook_awaits_gets_the_hook(tmp_path, impl):
    calls = asyncio.run(run_with_reload(impl, tmp_path))
    assert calls == ["a", "doneold", "bnew"], calls


# -- which addons implement a hook is remembered until the addon tree changes ------------------------

C = """
import hookrec
{body}
"""


def test_a_script_that_gains_a_hook_on_reload_gets_it_at_the_next_trigger(tmp_path):
    async def go():
        rec = types.ModuleType("hookrec")
        rec.calls = []
        sys.modules["hookrec"] = rec
        path = tmp_path / "c.py"
        path.write_text(C.format(body="def response(flow):\n    hookrec.calls.append('response')"))
        sl = ScriptLoader()
        with taddons.context(sl) as tctx:
            tctx.configure(sl, scripts=[str(path)])
            await asyncio.sleep(0.05)
            manager, flow = tctx.master.addons, tflow.tflow()
            await hook_chain.trigger(manager, HttpRequestHook(flow))  # nobody implements `request` yet
            assert not hook_chain.implementers(manager, "request")
            path.write_text(C.format(body="def request(flow):\n    hookrec.calls.append('request')"))
            sl.addons[0].loadscript()
            await hook_chain.trigger(manager, HttpRequestHook(flow))
            for s in sl.addons:
                if s.reloadtask:
                    s.reloadtask.cancel()
        return rec.calls

    assert asyncio.run(go()) == ["request"]


def test_the_remembered_implementers_follow_addons_added_and_removed():
    calls: list[str] = []

    async def go():
        with taddons.context(Rec("a", calls)) as tctx:
            manager = tctx.master.addons
            hook = HttpRequestHook(tflow.tflow())
            await hook_chain.trigger(manager, hook)
            later = Rec("later", calls)
            manager.add(later)
            await hook_chain.trigger(manager, hook)
            manager.remove(later)
            await hook_chain.trigger(manager, hook)

    asyncio.run(go())
    assert calls == ["a", "a", "later", "a"]
