"""gateway.task_wait without a mesh: a tenant's waiting tasks ask again one at a time,
first refused first; a new task joins a busy line behind them; the wait is bounded
(a delay past the bound fails at once, a line that does not move in time fails when
the bound passes), and the failure carries no retry delay."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.task_wait import MIN_HOLD_S, WaitingLines
from meshserve.errors import ResourceExhausted


def refusal(delay_s: float) -> ResourceExhausted:
    return ResourceExhausted("scheduler: tenant 'a' is over its rate limit", delay_s)


async def test_waiting_tasks_ask_again_one_at_a_time_in_the_order_they_were_refused():
    lines = WaitingLines(max_wait_s=30)
    order: list[str] = []

    async def task(name: str, refused_after_s: float) -> None:
        await asyncio.sleep(refused_after_s)
        place = lines.place("a")
        await place.wait(refusal(0.0))
        order.append(name)
        await asyncio.sleep(0.05)  # its run, until admitted
        place.admitted()
        place.leave()

    await asyncio.gather(task("third", 0.02), task("first", 0.0), task("second", 0.01), task("fourth", 0.03))
    assert order == ["first", "second", "third", "fourth"]
    assert len(lines) == 0  # an idle line is dropped


async def test_lines_of_many_priorities_leave_nothing_behind():
    """A tenant cycling through priorities (any int32) must not grow the gateway's memory:
    a line nobody holds or waits for is dropped, also after a wait in it timed out."""
    lines = WaitingLines(max_wait_s=0.4)
    for priority in (-(2**31), 0, 2**31 - 1):
        place = lines.place("a", priority)
        await place.wait(refusal(0.0))
        assert len(lines) == 1
        place.leave()
    assert len(lines) == 0
    head, behind = lines.place("a", 7), lines.place("a", 7)
    await head.wait(refusal(0.0))
    with pytest.raises(ResourceExhausted, match="may wait no longer"):  # its turn does not come in time
        await behind.join_if_busy()
    assert len(lines) == 1
    head.leave()
    assert len(lines) == 0


async def test_each_tenant_has_its_own_line_and_a_new_task_joins_a_busy_one():
    lines = WaitingLines(max_wait_s=30)
    head = lines.place("a")
    await head.wait(refusal(0.0))  # at the head of a's line: a new task of a waits behind it
    newcomer, other = lines.place("a"), lines.place("b")
    assert newcomer.busy and not other.busy
    await asyncio.wait_for(other.join_if_busy(), 1)  # b's line is empty: no wait
    joined = asyncio.create_task(newcomer.join_if_busy())
    await asyncio.sleep(0.1)
    assert not joined.done()
    head.admitted()
    await asyncio.wait_for(joined, 1)
    newcomer.leave()
    assert not lines.place("a").busy


async def test_a_line_stays_busy_between_a_release_and_its_next_holder_waking():
    """Found by a review: ``asyncio.Lock`` reads unlocked between a release and the
    woken waiter's run, when a newcomer could have asked ahead of it."""
    lines = WaitingLines(max_wait_s=30)
    head, behind = lines.place("a"), lines.place("a")
    await head.wait(refusal(0.0))
    waiting = asyncio.create_task(behind.wait(refusal(0.0)))
    await asyncio.sleep(0.05)
    head.admitted()  # the lock is free; the woken waiter has not run yet
    assert lines.place("a").busy
    await waiting
    behind.leave()
    assert not lines.place("a").busy


async def test_a_higher_priority_has_a_line_of_its_own():
    lines = WaitingLines(max_wait_s=30)
    low = lines.place("a", priority=0)
    await low.wait(refusal(0.0))
    assert lines.place("a", priority=0).busy and not lines.place("a", priority=5).busy
    low.leave()


async def test_a_delay_past_the_bound_fails_at_once_without_a_retry_delay():
    lines = WaitingLines(max_wait_s=1.0)
    place = lines.place("a")
    waiting = place.wait(refusal(5.0))
    with pytest.raises(ResourceExhausted) as info:
        waiting.send(None)  # "at once": its first step raises; it never suspends (no sleep, no wait for the line)
    assert info.value.retry_after_s is None
    assert str(info.value) == ("scheduler: tenant 'a' is over its rate limit; the task waited 0.0 s for "
                               "admission and may wait at most 1 s (--task-max-wait-s)")


async def test_a_line_that_does_not_move_fails_the_task_when_the_bound_passes():
    lines = WaitingLines(max_wait_s=0.5)
    head = lines.place("a")
    await head.wait(refusal(0.0))  # never admitted
    behind = lines.place("a")
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as info:
        async with asyncio.timeout(60):  # a hang bound: a wait the bound never ends is a TimeoutError here
            await behind.wait(refusal(0.0))
    assert time.monotonic() - started > 0.4 and info.value.retry_after_s is None  # not before the bound
    assert "may wait at most 0.5 s (--task-max-wait-s)" in str(info.value)
    head.leave()
    assert not lines.place("a").busy  # the timed-out waiter left nothing behind in the line


def test_the_wait_is_at_least_the_minimum_hold():
    place = WaitingLines().place("a")
    assert place.delay_s(refusal(0.0)) == MIN_HOLD_S and place.delay_s(refusal(2.5)) == 2.5
    with pytest.raises(ValueError, match="max_wait_s must be > 0"):
        WaitingLines(max_wait_s=0)
