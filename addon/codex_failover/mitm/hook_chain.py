"""An addon hook run on every addon, as mitmproxy's AddonManager runs it, without its per-addon cost.

mitmproxy 12.3.1's `AddonManager.trigger_event` creates a coroutine and a context manager for each
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

import asyncio
import inspect
import logging
import sys
import types

from mitmproxy import exceptions, flow as mitmflow
from mitmproxy.addonmanager import cut_traceback
from mitmproxy.hooks import Hook, UpdateHook
from mitmproxy.proxy import events
from mitmproxy.proxy.mode_servers import ProxyConnectionHandler
from mitmproxy.utils import asyncio_utils

_addon_log = logging.getLogger("mitmproxy.addonmanager")  # where safecall logs an addon's error
_going_on: set[asyncio.Task] = set()  # hooks `start`ed that await something, until they end


def _implements(addon, name: str) -> bool:
    """Does `addon` or any addon under it have `name`? (Reads only; calls nothing.)"""
    if getattr(addon, name, None):
        return True
    if hasattr(addon, "addons"):
        for child in addon.addons:
            if _implements(child, name):
                return True
    return False


def _handlers(addon, name: str):
    """`addon`'s and its children's `name` callables, in mitmproxy's traverse order and as lazily:
    a child list is read when its turn comes (a script reloaded while an earlier handler awaits is
    called in its new version, as mitmproxy calls it)."""
    func = getattr(addon, name, None)
    if func:
        if callable(func):
            yield func
        elif not isinstance(func, types.ModuleType):  # a module named like a hook is skipped, as mitmproxy does
            yield _not_callable(f"Addon handler {name} ({addon}) not callable")
    if hasattr(addon, "addons"):
        for child in addon.addons:
            yield from _handlers(child, name)


def _not_callable(message: str):
    def fail(*_args):  # raised when its turn comes, as mitmproxy's lazy traversal raises it
        raise exceptions.AddonManagerError(message)
    return fail


async def trigger(manager, hook: Hook, args: list | None = None) -> None:
    """`AddonManager.trigger_event(hook)`, for the addons that implement it (`args`: `hook.args()`)."""
    args, name = hook.args() if args is None else args, hook.name
    # Walked afresh at every hook, as mitmproxy walks it: which addons implement a hook changes without
    # register/remove (an `addons` list appended to, a property that follows an option, a handler set in
    # `configure`, an addon added by an earlier handler of this very hook; tests/test_hook_chain.py).
    for addon in manager.chain:
        try:
            if not _implements(addon, name):  # most addons: no coroutine, no generator (nothing to call)
                continue
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
            if _implements(addon, name):
                return True
        except Exception:  # noqa: BLE001 - logged by trigger, in mitmproxy's words
            return True
    return False


async def lifecycle(manager, hook: Hook, args: list | None = None) -> None:
    """`AddonManager.handle_lifecycle(hook)`: the hook, then (for a flow) the update, if anyone listens.
    (`args`: `hook.args()`, which reads the hook's dataclass fields each time: 3-5 us.)"""
    args = hook.args() if args is None else args
    await trigger(manager, hook, args)
    if isinstance(args[0], mitmflow.Flow) and listens(manager, "update"):
        await trigger(manager, UpdateHook([args[0]]))


async def _client_handle_hook(self, hook) -> None:
    """mitmproxy's ProxyConnectionHandler.handle_hook (mode_servers.py), with `lifecycle`."""
    with self.timeout_watchdog.disarm():
        args = hook.args()
        (data,) = args
        await lifecycle(self.master.addons, hook, args)
        if isinstance(data, mitmflow.Flow):
            await data.wait_for_resume()


def speed_up(handler) -> None:
    """Run a client connection's hooks with `lifecycle` (once per connection; a handler class of
    another kind than mitmproxy's own keeps its own handle_hook)."""
    if "handle_hook" not in vars(handler) and type(handler).handle_hook is ProxyConnectionHandler.handle_hook:
        handler.handle_hook = types.MethodType(_client_handle_hook, handler)


def sped_up(handler) -> bool:
    """Does `handler` run its hooks with `_client_handle_hook` (`speed_up`)?"""
    return getattr(vars(handler).get("handle_hook"), "__func__", None) is _client_handle_hook


def start(handler, hook) -> bool:
    """Start a stream's blocking hook where its layers yielded it (on a sped-up client connection, or
    an attempt's kept connection), as `server_event` starts it (a task, eager under mitmproxy's task
    factory). True: it already ran to the end, and the caller hands the stream its `HookCompleted`
    at once, inside this `server_event`. False: it awaits something (an intercepted flow, an async
    addon) and completes as mitmproxy's `hook_task` completes it, through `server_event`. mitmproxy's
    own way always takes the False path: its `HookCompleted` waits for the lock the running
    `server_event` holds, one loop turn (docs/mitmproxy-12.3.1-replay-notes.md §11)."""
    state = "starting"  # -> "ran" (ended before create_task returned) or "went on" (the caller did)

    async def task() -> None:
        nonlocal state
        await handler.handle_hook(hook)
        if state == "went on":
            await handler.server_event(events.HookCompleted(hook))
        else:
            state = "ran"

    running = asyncio.get_running_loop().create_task(task())
    if state == "ran":
        return True
    # What mitmproxy's asyncio_utils.create_task adds, for a task that goes on: its name and client
    # (mitmproxy's watchdog shows them for a hook that hangs), and a reference (the loop keeps none).
    asyncio_utils.set_task_debug_info(running, name=f"handle_hook({hook.name})", client=handler.client.peername)
    _going_on.add(running)
    running.add_done_callback(_going_on.discard)
    state = "went on"
    return False


def in_place(http_layer, stream, command, handler, above=()):
    """A stream's blocking hook, which `http_layer.event_to_child` got from `stream` and does not
    yield: `start` it and, if it ran to its end, hand the stream its end at once. If it awaits, its
    end comes down from the top later: each HttpLayer `above` (with the child that leads down) is
    told where it goes, as it would have been had the command passed it."""
    if start(handler, command):
        del http_layer.command_sources[command]
        yield from http_layer.event_to_child(stream, events.HookCompleted(command))
    else:
        for outer, down in above:
            outer.command_sources[command] = down
