"""FailoverAddon is one leaf addon whose parts get their hooks from it (mitm/parts.py): every hook a
part has is called, in the parts' order, an awaitable awaited before the next part is called, an
exception ending the addon's turn, as mitmproxy called nested addons."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy import hooks

from codex_failover.mitm import parts
from codex_failover.mitm.addon import FailoverAddon


def test_no_part_has_a_hook_the_addon_does_not_call():
    addon = FailoverAddon()
    assert not hasattr(addon, "addons")  # a leaf: mitmproxy walks no tree under it
    for part in addon.parts:
        assert not hasattr(part, "addons"), part
        for name in hooks.all_hooks:
            if callable(getattr(part, name, None)):
                assert name in parts.HOOKS or name in parts.OWN, (type(part).__name__, name)
                if name in parts.OWN:  # the addon's own handler calls it: the boundary's and the limits', today
                    assert part is addon.boundary or (part is addon.limits and name == "configure"), \
                        (type(part).__name__, name)
    for name in parts.HOOKS:
        assert callable(getattr(addon, name)) and addon._on[name], name  # each is some part's


def test_a_parts_hook_and_the_command_it_had_are_the_addons():
    addon = FailoverAddon()
    assert [h.__self__ for h in addon._on["response"]] == [p for p in addon.parts if hasattr(p, "response")]
    assert FailoverAddon.reset.command_name == "failover.reset"  # (was the AccountBack part's)


def _run(handlers, arg="f"):
    result = parts.each(tuple(handlers), arg)
    if result is not None:
        asyncio.run(result)
    return result


@pytest.mark.parametrize("kinds, awaited", [
    ("", False),
    ("sss", False),
    ("a", True),
    ("sas", True),
    ("aas", True),
    ("ssa", True),
])
def test_each_calls_every_handler_in_order_and_awaits_one_before_the_next(kinds, awaited):
    calls: list[str] = []

    def handler(i, kind):
        def sync(arg):
            calls.append(f"{i}:{arg}")

        def later(arg):
            calls.append(f"{i}:{arg}")

            async def wait():
                await asyncio.sleep(0)
                calls.append(f"{i} done")
            return wait()
        return sync if kind == "s" else later

    result = _run([handler(i, k) for i, k in enumerate(kinds)])
    expected = []
    for i, k in enumerate(kinds):
        expected += [f"{i}:f"] + ([f"{i} done"] if k == "a" else [])
    assert calls == expected and (result is not None) == awaited


def test_an_exception_ends_the_turn_at_that_handler_sync_or_after_an_await():
    calls: list[str] = []

    def boom(_arg):
        raise ValueError("x")

    with pytest.raises(ValueError):
        _run([lambda a: calls.append("first"), boom, lambda a: calls.append("never")])

    async def waits():
        calls.append("waited")

    with pytest.raises(ValueError):
        _run([lambda a: waits(), boom, lambda a: calls.append("never")])
    assert calls == ["first", "waited"]
