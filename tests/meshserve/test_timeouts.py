"""Timeouts and background tasks that never lose a cancellation, so a service's
shutdown cannot hang: ``meshserve.timeouts.wait_for`` and ``BackgroundTask.stop``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.task_readiness import TaskStoreProbe
from meshserve import background
from meshserve.background import BackgroundTask
from meshserve.timeouts import poll_until, wait_for


async def test_wait_for_returns_the_result_or_raises_timeout_error_and_cancels_the_awaitable():
    assert await wait_for(asyncio.sleep(0, result=7), 5) == 7
    assert await wait_for(asyncio.sleep(0, result=8), None) == 8
    inner = asyncio.create_task(asyncio.sleep(3600))
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(inner, 0.01)
    assert inner.cancelled()


async def test_a_cancel_landing_as_the_ping_returns_stops_the_task_store_probe():
    """The ping answers at once and the probe's task is cancelled in the very next loop
    iteration, before the ping's completion wakes the probe: where Python 3.11's
    ``asyncio.wait_for`` returned the ping's result and dropped the cancel, leaving the
    probe polling and the gateway's shutdown waiting on it for good. Here the cancel
    ends the probe (the wait's 10 s only bounds a hang)."""
    reports = []
    probe: TaskStoreProbe

    async def check():
        asyncio.get_running_loop().call_soon(probe._task.cancel)

    async def report(ready: bool):
        reports.append(ready)

    probe = TaskStoreProbe(check, report, poll_s=3600)
    probe.start()
    await asyncio.wait({probe._task}, timeout=10)
    assert probe._task.cancelled()
    assert reports == [True]


class SwallowsOneCancel(BackgroundTask):
    def __init__(self):
        self.cancels = 0

    async def _run(self):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancels += 1
                if self.cancels > 1:
                    raise


async def test_stop_cancels_again_a_task_that_swallowed_the_cancel(monkeypatch, caplog):
    monkeypatch.setattr(background, "RECANCEL_S", 0.05)
    task = SwallowsOneCancel()
    task.start()
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="meshserve.background"):
        await asyncio.wait_for(task.stop(), 10)
    assert task.cancels == 2 and task._task is None
    assert [r.getMessage() for r in caplog.records] == [
        "SwallowsOneCancel still runs 0.05 s after a cancel: cancelling it again"]
    await task.stop()  # idempotent


async def test_poll_until_says_whether_the_condition_came_true_within_its_time():
    checks = []

    def done_on_third() -> bool:
        checks.append(1)
        return len(checks) == 3

    assert await poll_until(done_on_third, 5.0, 0.001) is True and len(checks) == 3
    checks.clear()
    assert await poll_until(lambda: checks.append(1) is not None, -1.0, 0.001) is False and len(checks) == 1
