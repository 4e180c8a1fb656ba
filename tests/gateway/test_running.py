"""``gateway.running``: a stopping gateway ends the guarded streams still running,
wherever their task waits, with its error, after the stream's own cleanup."""

import asyncio

import pytest

from gateway.http.streams import EventPump
from gateway.running import RunningRequests, grace_ran_out_message
from meshserve.errors import Unavailable


class Stream:
    """A core stream stand-in: yields 0, 1, … as ``feed`` allows; records its cleanup."""

    def __init__(self):
        self.feed: asyncio.Queue = asyncio.Queue()
        self.cleaned_up = False

    async def events(self):
        try:
            i = 0
            while True:
                await self.feed.get()
                yield i
                i += 1
        finally:
            await asyncio.sleep(0)  # an awaiting cleanup (the lease's release)
            self.cleaned_up = True


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


async def test_a_stream_waiting_for_its_next_event_ends_with_the_error_after_its_cleanup():
    running, stream = RunningRequests(), Stream()
    got = []

    async def caller():
        async for event in running.guard(stream.events()):
            got.append(event)

    task = asyncio.create_task(caller())
    stream.feed.put_nowait(None)
    await _until(lambda: got == [0])
    assert len(running) == 1
    assert running.end_all(lambda: Unavailable("stopping")) == 1
    with pytest.raises(Unavailable, match="stopping"):
        await task
    assert stream.cleaned_up and len(running) == 0
    assert task.cancelling() == 0  # the cancellation was turned into the error


async def test_a_stream_whose_caller_waits_elsewhere_is_closed_at_once_and_raises_at_the_next_ask():
    running, stream = RunningRequests(), Stream()
    guarded = running.guard(stream.events())
    stream.feed.put_nowait(None)
    assert await anext(guarded) == 0  # the caller now writes to a slow client: the guard waits at its yield
    running.end_all(lambda: Unavailable("stopping"))
    assert await running.wait_ended(5)  # closed from outside: cleaned up without the caller
    assert stream.cleaned_up
    with pytest.raises(Unavailable, match="stopping"):
        await anext(guarded)
    await guarded.aclose()


async def test_a_caller_that_goes_away_is_a_cancellation_and_a_stream_after_end_all_fails_at_once():
    running, stream = RunningRequests(), Stream()

    async def caller(s):
        async for _ in running.guard(s.events()):
            pass

    task = asyncio.create_task(caller(stream))
    await _until(lambda: len(running) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.cleaned_up and len(running) == 0
    running.end_all(lambda: Unavailable("stopping"))
    late = Stream()
    with pytest.raises(Unavailable, match="stopping"):
        await caller(late)
    assert late.cleaned_up is False  # never started


async def test_stop_waits_out_the_grace_then_ends_what_runs_saying_so(caplog):
    running, stream = RunningRequests(), Stream()
    assert await running.stop(0.0) is True  # nothing runs: no wait

    async def caller():
        async for _ in running.guard(stream.events()):
            pass

    task = asyncio.create_task(caller())
    await _until(lambda: len(running) == 1)
    assert await running.stop(0.1) is False
    with pytest.raises(Unavailable) as info:
        await task
    assert str(info.value) == grace_ran_out_message(0.1) == (
        "the gateway is stopping and its grace of 0.1 s ran out before this request finished; "
        "the request can be retried")
    assert "1 requests still running after the gateway's 0.1 s grace" in caplog.text


@pytest.mark.parametrize("first", ["caller", "end_all"])
async def test_a_caller_that_goes_away_as_end_all_ends_its_stream_stays_a_cancellation(first):
    """The caller's cancel and end_all's land in the same loop step (a client that
    disconnects, a gRPC deadline, as the grace runs out), in either order: the task
    ends cancelled, its cancel not swallowed into end_all's error."""
    running, stream = RunningRequests(), Stream()

    async def caller():
        async for _ in running.guard(stream.events()):
            pass

    task = asyncio.create_task(caller())
    await _until(lambda: len(running) == 1)
    if first == "caller":
        task.cancel()
        running.end_all(lambda: Unavailable("stopping"))
    else:
        running.end_all(lambda: Unavailable("stopping"))
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.cleaned_up and len(running) == 0


async def test_an_event_pump_cancelled_as_end_all_ends_its_stream_ends_even_with_its_queue_full():
    """The HTTP client went away (the pump cancelled, its queue full: nobody reads it
    any more) as end_all ended the stream: the pump's task ends, it does not wait
    forever to hand over end_all's error."""
    running = RunningRequests()

    async def events():
        i = 0
        while True:
            await asyncio.sleep(0 if i < 2 else 60)
            yield i
            i += 1

    pump = EventPump([running.guard(events())], maxsize=2)
    await _until(lambda: pump._queue.full())
    await asyncio.sleep(0.01)  # the pump waits inside the stream for its third event
    pump.cancel()
    running.end_all(lambda: Unavailable("stopping"))
    await asyncio.wait_for(asyncio.gather(pump._task, return_exceptions=True), 5)
    assert len(running) == 0
