"""``EventPump``'s ``on_done``: called once its task has ended, after the streams it
started cleaned up, and also when it was cancelled before any stream started (an
unstarted generator's ``finally`` never runs, so ``on_done`` is its cleanup)."""

from __future__ import annotations

import asyncio

from gateway.http.streams import EventPump


async def test_cancelled_before_it_ran_on_done_still_runs_and_no_stream_started():
    log = []

    async def stream(i):
        log.append(f"start {i}")
        try:
            yield i
        finally:
            log.append(f"finally {i}")

    done = asyncio.Event()
    pump = EventPump([stream(0), stream(1)], on_done=lambda: (log.append("on_done"), done.set()))
    pump.cancel()  # before the event loop ran its task
    await asyncio.wait_for(done.wait(), 60)  # a hang bound: on_done never called
    assert log == ["on_done"]


async def test_on_done_runs_after_the_started_streams_clean_up():
    log = []

    async def stream(i):
        try:
            yield i
            await asyncio.Event().wait()
        finally:
            log.append(f"finally {i}")

    done = asyncio.Event()
    pump = EventPump([stream(0), stream(1)], on_done=lambda: (log.append("on_done"), done.set()))
    assert sorted([await pump.next(), await pump.next()]) == [(0, 0), (1, 1)]
    pump.cancel()
    await asyncio.wait_for(done.wait(), 60)  # a hang bound: on_done never called
    assert sorted(log[:2]) == ["finally 0", "finally 1"] and log[2:] == ["on_done"]
