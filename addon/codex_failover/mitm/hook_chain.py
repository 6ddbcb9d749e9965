"""An addon hook run on every addon, as mitmproxy's AddonManager runs it, without its per-addon cost.

Why it exists: CPU. A held request is two flows (the client's and its attempt's), each of whose hooks
mitmproxy sends to every top-level addon: measured side by side with plain mitmdump (`scripts/bench
--cost`), mitmproxy's own dispatch costs this addon 1.2-1.6 ms of CPU per request (2.0x plain mitmdump
per request against 1.5x with this module), which a proxy left on all day pays on every request.

mitmproxy 12's `AddonManager.trigger_event` creates a coroutine and a context manager for each
top-level addon whether or not it implements the hook, and `handle_lifecycle` follows every flow hook
with an `UpdateHook` sent the same way, although mitmdump has no addon that listens to `update`.
Measured on mitmdump's chain with this addon loaded (36 top-level addons, 42 in all): 65-90 us per
hook, 130-155 us with the update, for 3-14 addons that implement it. A held request pays that on its
way: twice for its first attempt before it leaves, and once for the client flow's `responseheaders`
between the decision and the first output.

`trigger` makes the same calls, in the same order (an addon tree is walked as lazily as mitmproxy
walks it), with the same errors: an exception in an addon is logged as mitmproxy's `safecall` logs
it and ends that top-level addon's turn; `AddonHalt` ends the hook; `OptionsError` propagates.
`lifecycle` adds the `UpdateHook` when some addon listens.
docs/mitmproxy-12.3.1-replay-notes.md §11.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

from mitmproxy import ctx, exceptions, flow as mitmflow
from mitmproxy.addonmanager import cut_traceback
from mitmproxy.hooks import Hook, UpdateHook

from . import fallbacks

_addon_log = logging.getLogger("mitmproxy.addonmanager")  # where safecall logs an addon's error
# The dispatch below mirrors this mitmproxy's AddonManager (tests/test_hook_chain.py checks each case
# against it, on each release in fallbacks.TESTED). On any other release mitmproxy's own dispatch is used:
# slower, never different.
MIRRORS = fallbacks.seam_holds("hooks")


def _implements(addon, name: str) -> bool:
    """Does `addon` or any addon under it have `name`? (Reads only; calls nothing.)"""
    if getattr(addon, name, None):
        return True
    if hasattr(addon, "addons"):
        for child in addon.addons:
            if getattr(child, name, None) or (hasattr(child, "addons") and _implements(child, name)):
                return True  # (a leaf child read in place: no call per child)
    return False


def _handlers(addon, name: str):
    """`addon`'s and its children's `name` callables, in mitmproxy's traverse order and as lazily:
    a child list is read when its turn comes (a script reloaded while an earlier handler awaits is
    called in its new version, as mitmproxy calls it)."""
    func = getattr(addon, name, None)
    if func:
        yield _callable(addon, name, func)
    if hasattr(addon, "addons"):
        for child in addon.addons:
            if hasattr(child, "addons"):
                yield from _handlers(child, name)
            elif func := getattr(child, name, None):  # a leaf child read in place: no generator per child
                yield _callable(child, name, func)


def _callable(addon, name: str, func):
    if callable(func):
        return func
    if isinstance(func, types.ModuleType):  # a module named like a hook is skipped, as mitmproxy does
        return _skip
    return _not_callable(f"Addon handler {name} ({addon}) not callable")


def _skip(*_args) -> None:
    return None


def _not_callable(message: str):
    def fail(*_args):  # raised when its turn comes, as mitmproxy's lazy traversal raises it
        raise exceptions.AddonManagerError(message)
    return fail


async def trigger(manager, hook: Hook, args: list | None = None) -> None:
    """`AddonManager.trigger_event(hook)`, for the addons that implement it (`args`: `hook.args()`)."""
    if not MIRRORS:
        await manager.trigger_event(hook)
        return
    args, name = hook.args() if args is None else args, hook.name
    # Walked afresh at every hook, as mitmproxy walks it: which addons implement a hook changes without
    # register/remove (an `addons` list appended to, a property that follows an option, a handler set in
    # `configure`, an addon added by an earlier handler of this very hook; tests/test_hook_chain.py).
    for addon in manager.chain:
        try:
            # Most addons are leaves without the hook: two attribute reads, no call (a third of a
            # request's dispatch CPU went to walking them through `_implements`).
            func = getattr(addon, name, None)
            if not hasattr(addon, "addons"):
                if not func:
                    continue
                if callable(func):
                    result = func(*args)
                    if result is not None and inspect.isawaitable(result):
                        await result
                    continue
            # An addon tree (mitmdump's script loader, whose scripts hold this addon) is walked once: it
            # implements a request's hooks, and a walk to find out first was a second walk.
            for func in _handlers(addon, name):
                result = func(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
        except exceptions.AddonHalt:
            return
        except exceptions.OptionsError:
            raise
        except Exception:
            etype, value, tb = sys.exc_info()
            _addon_log.error(f"Addon error: {value}", exc_info=(etype, value, cut_traceback(tb, "trigger")))


def listens(manager, name: str) -> bool:
    """Does any addon implement hook `name`? An addon whose tree cannot be read might: `trigger` then
    logs its error, as mitmproxy does for every hook it sends."""
    for addon in manager.chain:
        try:
            if getattr(addon, name, None) or (hasattr(addon, "addons") and _implements(addon, name)):
                return True
        except Exception:  # noqa: BLE001 - logged by trigger, in mitmproxy's words
            return True
    return False


async def lifecycle(manager, hook: Hook, args: list | None = None) -> None:
    """`AddonManager.handle_lifecycle(hook)`: the hook, then (for a flow) the update, if anyone listens.
    (`args`: `hook.args()`, which reads the hook's dataclass fields each time: 3-5 us.)"""
    if not MIRRORS:
        await manager.handle_lifecycle(hook)
        return
    args = hook.args() if args is None else args
    await trigger(manager, hook, args)
    if isinstance(args[0], mitmflow.Flow) and listens(manager, "update"):
        await trigger(manager, UpdateHook([args[0]]))


async def client_handle_hook(self, hook) -> None:
    """mitmproxy's ProxyConnectionHandler.handle_hook (mode_servers.py), with `lifecycle`: set on a
    held client's connection handler by the hop (client_hop.speed_up)."""
    with self.timeout_watchdog.disarm():
        args = hook.args()
        (data,) = args
        await lifecycle(self.master.addons, hook, args)
        if isinstance(data, mitmflow.Flow):
            await data.wait_for_resume()


async def run_hook(hook: Hook) -> None:
    """An attempt flow's hook, as mitmproxy runs a flow's hooks, at a lower CPU cost (as above)."""
    await lifecycle(ctx.master.addons, hook)
