"""hook_chain runs a hook as mitmproxy's AddonManager does: the same calls in the same order, the same
errors logged, AddonHalt and OptionsError as there; the update only when an addon listens."""

import asyncio
import logging
import sys
import types

import pytest
from mitmproxy import ctx, exceptions
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


def test_on_a_mitmproxy_it_does_not_mirror_the_hooks_are_mitmproxys_own(monkeypatch):
    """The fallback, chosen at import from mitmproxy's version: every hook through the AddonManager
    itself (the update included), so an unknown release costs CPU, never a handler."""
    monkeypatch.setattr(hook_chain, "MIRRORS", False)
    calls: list[str] = []
    listener = Listener()
    flow = tflow.tflow()

    async def go():
        with taddons.context(Rec("a", calls), listener) as tctx:
            seen = []
            monkeypatch.setattr(tctx.master.addons, "trigger_event",
                                _spy(tctx.master.addons.trigger_event, seen))
            await hook_chain.lifecycle(tctx.master.addons, HttpRequestHook(flow))
            await hook_chain.trigger(tctx.master.addons, HttpRequestHook(flow))
            return seen

    seen = asyncio.run(go())
    assert calls == ["a", "a"] and listener.updates == [[flow]]
    assert seen == ["request", "update", "request"]  # mitmproxy's own dispatch did it all


def _spy(trigger_event, seen):
    async def spy(hook):
        seen.append(hook.name)
        await trigger_event(hook)
    return spy


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


# -- which addons implement a hook can change between two hooks, and within one ----------------------
# (an adversarial review of a cache of it found each of these; mitmproxy walks the tree at every hook)

async def fire(impl, manager, hook):
    if impl == "mitmproxy":
        await manager.trigger_event(hook)
    else:
        await hook_chain.trigger(manager, hook)


IMPLS = ["mitmproxy", "hook_chain"]


class Parent:
    def __init__(self):
        self.addons = []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_child_appended_to_addons_without_register_gets_the_next_hook(impl):
    calls: list[str] = []

    async def go():
        parent = Parent()
        with taddons.context(parent) as tctx:
            await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))  # nobody implements it yet
            parent.addons.append(Rec("child", calls))
            await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))

    asyncio.run(go())
    assert calls == ["child"]


class Feature:
    """Its `addons` follow an option, as mitmproxy's own Script.addons follow its module."""

    def __init__(self, calls):
        self.on, self.impl = False, Rec("impl", calls)

    def load(self, loader):
        loader.add_option("test_feature", bool, False, "turn the feature on")

    def configure(self, updated):
        self.on = ctx.options.test_feature

    @property
    def addons(self):
        return [self.impl] if self.on else []


class Dumper:
    """Its hook is set in `configure`, when an option turns it on."""

    def __init__(self, calls):
        self.calls, self.request = calls, None

    def load(self, loader):
        loader.add_option("test_dump", bool, False, "dump requests")

    def configure(self, updated):
        self.request = self._dump if ctx.options.test_dump else None

    def _dump(self, flow):
        self.calls.append("dump")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["child", "method"])
def test_an_option_set_at_runtime_that_turns_a_hook_on_takes_effect_at_the_next_hook(impl, kind):
    calls: list[str] = []

    async def go():
        addon, option = (Feature(calls), "test_feature") if kind == "child" else (Dumper(calls), "test_dump")
        with taddons.context(addon) as tctx:
            await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))
            tctx.options.update(**{option: True})  # `:set`, or mitmweb's options
            await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))

    asyncio.run(go())
    assert calls == ["impl" if kind == "child" else "dump"]


class Adder:
    def __init__(self, calls):
        self.calls, self.added = calls, False

    def request(self, flow):
        self.calls.append("adder")
        if not self.added:
            self.added = True
            ctx.master.addons.add(Rec("late", self.calls))


@pytest.mark.parametrize("impl", IMPLS)
def test_an_addon_added_by_a_handler_gets_the_same_hook(impl):
    calls: list[str] = []

    async def go():
        with taddons.context(Adder(calls)) as tctx:
            await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))

    asyncio.run(go())
    assert calls == ["adder", "late"]


class Waiter:
    def __init__(self, calls, gate):
        self.calls, self.gate = calls, gate

    async def request(self, flow):
        self.calls.append("waiter")
        await self.gate.wait()


NEW = """
import hookrec
def request(flow):
    hookrec.calls.append("new script")
"""


@pytest.mark.parametrize("impl", IMPLS)
def test_a_script_added_while_an_earlier_hook_awaits_gets_the_hook(impl, tmp_path):
    rec = types.ModuleType("hookrec")
    rec.calls = []
    sys.modules["hookrec"] = rec
    path = tmp_path / "new.py"
    path.write_text(NEW)

    async def go():
        gate, sl = asyncio.Event(), ScriptLoader()
        with taddons.context(Waiter(rec.calls, gate), sl) as tctx:
            task = asyncio.create_task(fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow())))
            await asyncio.sleep(0.01)
            tctx.options.update(scripts=[str(path)])  # `:set scripts=...`
            await asyncio.sleep(0.05)
            gate.set()
            await task
            for s in sl.addons:
                s.reloadtask.cancel()

    asyncio.run(go())
    assert rec.calls == ["waiter", "new script"]


C = """
import hookrec
{body}
"""


def test_a_script_that_gains_a_hook_on_reload_gets_it_at_the_next_hook(tmp_path):
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
            path.write_text(C.format(body="def request(flow):\n    hookrec.calls.append('request')"))
            sl.addons[0].loadscript()
            await hook_chain.trigger(manager, HttpRequestHook(flow))
            for s in sl.addons:
                s.reloadtask.cancel()
        return rec.calls

    assert asyncio.run(go()) == ["request"]


def test_addons_added_and_removed_are_called_as_mitmproxy_calls_them():
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


class Flaky:
    """An addon whose tree cannot be read: its `addons` raise."""

    @property
    def addons(self):
        raise RuntimeError("flaky")


@pytest.mark.parametrize("impl", IMPLS)
def test_an_addon_whose_tree_raises_is_logged_and_the_next_addons_get_the_hook(impl, caplog):
    calls: list[str] = []

    async def go():
        with taddons.context(Rec("before", calls)) as tctx:
            tctx.master.addons.chain.append(Flaky())  # as registered: `register` itself would read its tree
            tctx.master.addons.chain.append(Rec("after", calls))
            with caplog.at_level(logging.ERROR):
                await fire(impl, tctx.master.addons, HttpRequestHook(tflow.tflow()))

    asyncio.run(go())
    assert calls == ["before", "after"]
    assert any(r.getMessage() == "Addon error: flaky" for r in caplog.records)


def test_lifecycle_with_an_addon_whose_tree_raises_sends_the_update_and_logs_it(caplog):
    """mitmproxy sends the update to every addon, and logs the one it cannot read; so does lifecycle."""
    calls: list[str] = []
    listener = Listener()

    async def go():
        with taddons.context(Rec("a", calls)) as tctx:
            tctx.master.addons.chain.append(Flaky())
            tctx.master.addons.chain.append(listener)
            caplog.clear()
            with caplog.at_level(logging.ERROR):
                await hook_chain.lifecycle(tctx.master.addons, HttpRequestHook(tflow.tflow()))
            return [r.getMessage() for r in caplog.records]

    logged = asyncio.run(go())
    assert calls == ["a"] and len(listener.updates) == 1
    assert logged.count("Addon error: flaky") == 2, logged  # the hook, then the update
