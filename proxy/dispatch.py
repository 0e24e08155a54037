"""Hook dispatch that skips addons without the hook (installed by the addon on load).

mitmproxy 12 dispatches every event to every addon in the chain: per addon it enters a
generator-based `safecall()` context manager, creates an `invoke_addon` coroutine, walks the
addon's sub-addons with a generator and looks the hook up with getattr. mitmdump loads ~35
addons, and each HTTP exchange triggers ~10 events plus an `update` event after every flow
event, most of which no addon implements: measured 86 µs per `update` trigger that reaches no
hook at all, ~1 ms of the ~2.5 ms of CPU plain mitmdump spends per proxied request
(tests/bench/proxy_overhead.py; decision 13 in docs/decisions.md).

`install(manager)` replaces `trigger_event` on that one AddonManager instance (not the class)
with a version that looks up, per event name, the precomputed list of hook callables and
calls only those. Semantics kept exactly:
- order: chain order, and within one chain entry the depth-first order of its sub-addons;
- errors: one `safecall()` per chain entry that has hooks, so an exception is logged as
  mitmproxy logs it and ends only that entry's remaining sub-addons; AddonHalt ends the event;
- async hooks are awaited; a non-callable hook attribute is reported as mitmproxy reports it
  (those entries are dispatched by mitmproxy's own code).
The table is rebuilt lazily after anything changes the addon tree through the manager
(`add`, `register`, `remove`, `clear`: this covers script loading and reloading, which
mitmproxy does through `register`/`remove`) and after every `configure` event, during which
the script loader edits its sub-addon list. An addon that swaps its own hook methods or
sub-addons at run time without going through the manager is not seen until the next
configure; no mitmproxy addon does, and Steward's does not.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

from mitmproxy import exceptions, hooks
from mitmproxy.addonmanager import AddonManager, safecall, traverse

log = logging.getLogger("steward.proxy")

# One chain entry's hooks for an event: [(addon, bound hook), ...], or None when the entry must
# go through mitmproxy's own invoke_addon (it has a non-callable attribute named like the hook).
EntryHooks = list[tuple[Any, Callable]] | None

_INSTALLED = "_steward_fast_dispatch"


def _entry_hooks(entry: Any, name: str) -> EntryHooks:
    found: list[tuple[Any, Callable]] = []
    for addon in traverse([entry]):
        func = getattr(addon, name, None)
        if not func or isinstance(func, types.ModuleType):
            continue  # mitmproxy skips modules named like a hook (e.g. `from x import log`)
        if not callable(func):
            return None
        found.append((addon, func))
    return found


class HookTable:
    """Per event name: the chain entries that implement it, with their hook callables."""

    def __init__(self, manager: AddonManager) -> None:
        self.manager = manager
        self._by_event: dict[str, list[tuple[Any, EntryHooks]]] = {}

    def invalidate(self) -> None:
        self._by_event = {}

    def entries(self, name: str) -> list[tuple[Any, EntryHooks]]:
        table = self._by_event.get(name)
        if table is None:
            table = []
            for entry in self.manager.chain:
                found = _entry_hooks(entry, name)
                if found is None or found:
                    table.append((entry, found))
            self._by_event[name] = table
        return table


def installed(manager: AddonManager) -> bool:
    return getattr(manager, _INSTALLED, None) is not None


def install(manager: AddonManager) -> HookTable:
    """Idempotent per manager. Returns the manager's hook table."""
    existing = getattr(manager, _INSTALLED, None)
    if existing is not None:
        return existing
    # Fail loudly, at start-up, if mitmproxy's dispatch is not the one this mirrors.
    for attr in ("chain", "trigger_event", "invoke_addon", "register", "remove", "clear", "add"):
        if not hasattr(manager, attr):
            raise RuntimeError(f"mitmproxy AddonManager has no {attr!r}: dispatch not installed")
    table = HookTable(manager)
    original_invoke = manager.invoke_addon

    async def trigger_event(event: hooks.Hook) -> None:
        args = event.args()
        for entry, found in table.entries(event.name):
            try:
                with safecall():
                    if found is None:
                        await original_invoke(entry, event)
                        continue
                    for _addon, func in found:
                        result = func(*args)
                        if result is not None and inspect.isawaitable(result):
                            await result
            except exceptions.AddonHalt:
                break

    def invalidating(method: Callable) -> Callable:
        def wrapper(*a: Any, **kw: Any) -> Any:
            try:
                return method(*a, **kw)
            finally:  # rebuilt lazily, at the next event, from the tree as it is then
                table.invalidate()

        wrapper.__name__ = method.__name__
        wrapper.__doc__ = method.__doc__
        return wrapper

    for attr in ("register", "remove", "clear", "add"):
        setattr(manager, attr, invalidating(getattr(manager, attr)))
    original_trigger = manager.trigger

    def trigger(event: hooks.Hook) -> None:
        try:
            original_trigger(event)
        finally:
            if event.name == "configure":  # the script loader edits its sub-addons here
                table.invalidate()

    manager.trigger = trigger
    manager.trigger_event = trigger_event
    setattr(manager, _INSTALLED, table)
    return table
