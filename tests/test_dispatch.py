"""proxy/dispatch.py: the same hooks in the same order as mitmproxy's own dispatch, only faster.

Each case runs the same scenario on two masters — mitmproxy's dispatch and ours — and compares
what the addons saw, so a difference in order, error handling or reloads fails here."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import textwrap
import time
from pathlib import Path

import pytest
from mitmproxy import addonmanager, exceptions, hooks, options
from mitmproxy.addons import script
from mitmproxy.master import Master
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import tflow
from mitmproxy.tools.dump import DumpMaster

from proxy import dispatch


class Recorder:
    def __init__(self, name: str, seen: list, sub: list | None = None) -> None:
        self.name = name
        self.seen = seen
        if sub is not None:
            self.addons = sub

    def request(self, flow) -> None:
        self.seen.append((self.name, "request", flow.id))

    def response(self, flow) -> None:
        self.seen.append((self.name, "response", flow.id))


class Failing(Recorder):
    def request(self, flow) -> None:
        self.seen.append((self.name, "request", flow.id))
        raise ValueError("boom")


class Halting(Recorder):
    def request(self, flow) -> None:
        self.seen.append((self.name, "request", flow.id))
        raise exceptions.AddonHalt()


class AsyncRecorder(Recorder):
    async def request(self, flow) -> None:
        await asyncio.sleep(0)
        self.seen.append((self.name, "async-request", flow.id))


class NotCallable:
    name = "notcallable"
    request = 42


class ModuleNamedLikeHook:
    name = "modulehook"
    request = logging  # e.g. `from x import request` at a script's top level


def run_both(build, scenario) -> tuple[list, list, list, list]:
    """Run `scenario(master, seen)` on a master with mitmproxy's dispatch and one with ours;
    returns (seen, error logs) for each."""
    results = []
    for fast in (False, True):
        seen: list = []

        async def go(seen: list, fast: bool) -> list[str]:
            master = Master(options.Options())
            for addon in build(seen):
                master.addons.add(addon)
            if fast:
                dispatch.install(master.addons)
            records: list[str] = []

            class Catch(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    records.append(record.getMessage())

            handler = Catch(logging.ERROR)
            logging.getLogger(addonmanager.__name__).addHandler(handler)
            try:
                await scenario(master, seen)
            finally:
                logging.getLogger(addonmanager.__name__).removeHandler(handler)
                await master.done()  # uninstalls the master's log handler (bound to this loop)
            return records

        logs = asyncio.run(go(seen, fast))
        results.append((seen, logs))
    (slow_seen, slow_logs), (fast_seen, fast_logs) = results
    return slow_seen, fast_seen, slow_logs, fast_logs


async def request_and_response(master: Master, seen: list) -> None:
    f = tflow.tflow(resp=True)
    await master.addons.handle_lifecycle(HttpRequestHook(f))
    await master.addons.handle_lifecycle(HttpResponseHook(f))


def test_order_with_nested_addons_matches_mitmproxy():
    def build(seen):
        return [Recorder("a", seen),
                Recorder("b", seen, sub=[Recorder("b1", seen, sub=[Recorder("b11", seen)]),
                                         Recorder("b2", seen)]),
                Recorder("c", seen)]

    slow, fast, _, _ = run_both(build, request_and_response)
    names = [(n, e) for n, e, _ in fast]
    assert names == [("a", "request"), ("b", "request"), ("b1", "request"), ("b11", "request"),
                     ("b2", "request"), ("c", "request"), ("a", "response"), ("b", "response"),
                     ("b1", "response"), ("b11", "response"), ("b2", "response"),
                     ("c", "response")]
    assert [(n, e) for n, e, _ in slow] == names


def test_an_error_is_logged_and_ends_only_that_entry():
    def build(seen):
        return [Recorder("a", seen),
                Failing("f", seen, sub=[Recorder("f1", seen)]),
                Recorder("c", seen)]

    slow, fast, slow_logs, fast_logs = run_both(build, request_and_response)
    assert [(n, e) for n, e, _ in fast] == [(n, e) for n, e, _ in slow]
    # f's own sub-addon f1 is skipped for `request` (same safecall), c still runs.
    assert [(n, e) for n, e, _ in fast][:3] == [("a", "request"), ("f", "request"),
                                                 ("c", "request")]
    assert fast_logs == slow_logs
    assert any("Addon error: boom" in m for m in fast_logs)


def test_addon_halt_stops_the_event():
    def build(seen):
        return [Recorder("a", seen), Halting("h", seen), Recorder("c", seen)]

    slow, fast, _, _ = run_both(build, request_and_response)
    assert [(n, e) for n, e, _ in fast] == [(n, e) for n, e, _ in slow] == [
        ("a", "request"), ("h", "request"), ("a", "response"), ("h", "response"),
        ("c", "response")]


def test_async_hooks_are_awaited():
    def build(seen):
        return [AsyncRecorder("x", seen), Recorder("y", seen)]

    slow, fast, _, _ = run_both(build, request_and_response)
    assert [(n, e) for n, e, _ in fast] == [(n, e) for n, e, _ in slow] == [
        ("x", "async-request"), ("y", "request"), ("x", "response"), ("y", "response")]


def test_non_callable_hook_reported_and_module_attribute_skipped():
    def build(seen):
        return [ModuleNamedLikeHook(), NotCallable(), Recorder("r", seen)]

    slow, fast, slow_logs, fast_logs = run_both(build, request_and_response)
    assert [(n, e) for n, e, _ in fast] == [(n, e) for n, e, _ in slow]
    assert ("r", "request") in [(n, e) for n, e, _ in fast]
    def strip_addresses(logs: list[str]) -> list[str]:
        return [re.sub(r"0x[0-9a-f]+", "0x", m) for m in logs]

    assert strip_addresses(fast_logs) == strip_addresses(slow_logs)
    assert any("not callable" in m for m in fast_logs)


def test_added_and_removed_addons_are_seen_after_the_first_dispatch():
    async def scenario(master: Master, seen: list) -> None:
        await request_and_response(master, seen)  # builds the table
        late = Recorder("late", seen)
        master.addons.add(late)
        await request_and_response(master, seen)
        master.addons.remove(late)
        await request_and_response(master, seen)

    def build(seen):
        return [Recorder("a", seen)]

    slow, fast, _, _ = run_both(build, scenario)
    assert [(n, e) for n, e, _ in fast] == [(n, e) for n, e, _ in slow]
    assert [n for n, _, _ in fast].count("late") == 2


def test_update_event_with_no_hook_reaches_nobody():
    seen: list = []

    class Updates(Recorder):
        def update(self, flows) -> None:
            seen.append(("u", "update", len(flows)))

    async def go() -> None:
        master = Master(options.Options())
        master.addons.add(Recorder("a", seen))
        table = dispatch.install(master.addons)
        f = tflow.tflow(resp=True)
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        assert table.entries("update") == []
        master.addons.add(Updates("u", seen))
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        await master.done()

    asyncio.run(go())
    assert seen[-1] == ("u", "update", 1)
    assert [e for _, e, _ in seen].count("update") == 1


def test_install_is_idempotent():
    async def go() -> None:
        master = Master(options.Options())
        first = dispatch.install(master.addons)
        trigger_event = master.addons.trigger_event
        assert dispatch.install(master.addons) is first
        assert master.addons.trigger_event is trigger_event
        await master.done()

    asyncio.run(go())


SCRIPT = """
seen = __import__("builtins").__dict__.setdefault("_steward_dispatch_seen", [])

def request(flow):
    seen.append(({tag!r}, flow.id))
"""


@pytest.fixture()
def script_seen():
    import builtins

    builtins._steward_dispatch_seen = []
    yield builtins._steward_dispatch_seen
    del builtins._steward_dispatch_seen


def test_scripts_loaded_reloaded_and_unloaded_through_mitmproxy(tmp_path: Path, script_seen):
    """The script loader edits its sub-addons during `configure` and on reload: the table
    follows both (a script's new version gets the next event, an unloaded one none)."""
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent(SCRIPT.format(tag="v1")))

    async def go() -> None:
        master = DumpMaster(options.Options(), with_termlog=False, with_dumper=False)
        dispatch.install(master.addons)
        f = tflow.tflow()
        await master.addons.handle_lifecycle(HttpRequestHook(f))  # table without the script
        master.options.update(scripts=[str(path)])
        loader: script.ScriptLoader = master.addons.get("scriptloader")
        for _ in range(200):  # the loader's watcher task loads the script (mitmproxy defers it)
            if loader.addons and loader.addons[0].ns is not None:
                break
            await asyncio.sleep(0.01)
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        path.write_text(textwrap.dedent(SCRIPT.format(tag="v2")))
        # Python's bytecode cache trusts a source of the same size and mtime (in seconds):
        # where bytecode is written (PYTHONDONTWRITEBYTECODE unset, a fresh machine) the
        # reload would run the cached v1 without this.
        stat = path.stat()
        os.utime(path, (stat.st_atime, stat.st_mtime + 2))
        loader.addons[0].loadscript()  # ctx.master is this master (set by Master.__init__)
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        master.options.update(scripts=[])
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        await master.done()

    asyncio.run(go())
    assert [tag for tag, _ in script_seen] == ["v1", "v2"]


def test_reordered_scripts_are_called_in_the_new_order(tmp_path: Path, script_seen):
    """Reordering `scripts` only reassigns the loader's list (no register/remove): the table
    is rebuilt after the configure event that does it."""
    one, two = tmp_path / "one.py", tmp_path / "two.py"
    one.write_text(textwrap.dedent(SCRIPT.format(tag="one")))
    two.write_text(textwrap.dedent(SCRIPT.format(tag="two")))

    async def go() -> None:
        master = DumpMaster(options.Options(), with_termlog=False, with_dumper=False)
        dispatch.install(master.addons)
        master.options.update(scripts=[str(one), str(two)])
        loader: script.ScriptLoader = master.addons.get("scriptloader")
        for _ in range(200):
            if len(loader.addons) == 2 and all(a.ns is not None for a in loader.addons):
                break
            await asyncio.sleep(0.01)
        f = tflow.tflow()
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        master.options.update(scripts=[str(two), str(one)])
        await master.addons.handle_lifecycle(HttpRequestHook(f))
        await master.done()

    asyncio.run(go())
    assert [tag for tag, _ in script_seen] == ["one", "two", "two", "one"]


def test_the_dispatch_is_cheaper_than_mitmproxys_on_mitmdumps_addons():
    """Not a timing target (those live in tests/bench/): a sanity check that an event no addon
    implements costs far less than a walk over mitmdump's ~35 addons, so a regression that
    silently falls back to the full walk fails."""
    async def per_trigger(fast: bool) -> float:
        master = DumpMaster(options.Options(), with_termlog=False, with_dumper=False)
        if fast:
            dispatch.install(master.addons)
        event = hooks.UpdateHook([tflow.tflow()])
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(300):
                await master.addons.trigger_event(event)
            best = min(best, (time.perf_counter() - t0) / 300)
        await master.done()
        return best

    slow, fast = asyncio.run(per_trigger(False)), asyncio.run(per_trigger(True))
    assert fast * 5 < slow, (fast, slow)
