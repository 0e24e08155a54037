"""The addon's upstream-timeout sweep (proxy/addon.py): one timer for every in-flight flow.

The end-to-end 504 is tested through a real mitmdump in test_proxy.py; this checks the
bookkeeping the sweep relies on (deadline order, disarm, the timer stopping when idle)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from mitmproxy.test import tflow

from proxy.addon import Steward


class Recording(Steward):
    def __init__(self) -> None:
        super().__init__()
        self.settings = SimpleNamespace(upstream_timeout=0.5)  # only field the sweep reads
        self.timed_out: list[str] = []

    def _on_timeout(self, flow) -> None:
        self.timed_out.append(flow.id)


def test_due_flows_time_out_in_order_and_disarmed_ones_never():
    async def go() -> Recording:
        addon = Recording()
        first, answered, second = tflow.tflow(), tflow.tflow(), tflow.tflow()
        addon._arm_timeout(first)
        addon._arm_timeout(answered)
        await asyncio.sleep(0.25)
        addon._arm_timeout(second)  # due 0.25 s after the first two
        addon._disarm_timeout(answered)  # its response headers came
        await asyncio.sleep(0.35)  # t=0.6: first due at 0.5 (swept every 0.05 s), second at 0.75
        assert addon.timed_out == [first.id]
        await asyncio.sleep(0.3)
        assert addon.timed_out == [first.id, second.id]
        await asyncio.sleep(0.1)
        assert addon._deadlines == {} and addon._sweep is None  # no timer while idle
        addon._arm_timeout(answered)  # a new flow starts the sweep again
        assert addon._sweep is not None
        return addon

    asyncio.run(go())


def test_one_failing_timeout_does_not_stop_the_others():
    class Failing(Recording):
        def _on_timeout(self, flow) -> None:
            super()._on_timeout(flow)
            raise RuntimeError("boom")

    async def go() -> Failing:
        addon = Failing()
        flows = [tflow.tflow() for _ in range(3)]
        for flow in flows:
            addon._arm_timeout(flow)
        await asyncio.sleep(0.7)
        assert addon.timed_out == [f.id for f in flows]
        return addon

    asyncio.run(go())
