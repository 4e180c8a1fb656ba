"""``gateway.lease_renewal.renewing``: a renewal every quarter of the lease's life,
none after a tick that followed an executor output (the executor's reports keep a
streaming request's lease), renewals again once outputs stop; driven tick by tick."""

import asyncio

from opentelemetry import trace

from gateway.lease_renewal import LeaseActivity, renewing
from gateway.mesh import Assignment
from meshserve.errors import NotFound, Unavailable


class RecordingScheduler:
    """The one call ``renewing`` makes (``MeshClient.renew``), recorded; ``errors``
    are raised by the next calls, in order."""

    def __init__(self, errors=()):
        self.renewed: list[str] = []
        self.errors = list(errors)

    async def renew(self, lease_id, span):
        self.renewed.append(lease_id)
        if self.errors:
            raise self.errors.pop(0)


class Ticks:
    """A ``sleep`` that returns when the test says: each ``tick()`` ends one wait."""

    def __init__(self):
        self.intervals: list[float] = []
        self._ticks: asyncio.Queue = asyncio.Queue()

    async def sleep(self, seconds):
        self.intervals.append(seconds)
        await self._ticks.get()

    async def tick(self):
        self._ticks.put_nowait(None)
        for _ in range(5):  # let the loop run its renewal and reach its next sleep
            await asyncio.sleep(0)


def assignment(ttl=10.0):
    return Assignment("e0", "addr", "lease-1", 0.0, b"", ttl, "acme")


async def test_a_streaming_request_is_not_renewed_and_one_that_stops_is():
    scheduler, ticks = RecordingScheduler(), Ticks()
    async with renewing(scheduler, assignment(), trace.INVALID_SPAN, ticks.sleep) as activity:
        await ticks.tick()
        assert scheduler.renewed == ["lease-1"]  # no output yet (before Execute): renewed
        for _ in range(3):  # outputs between every two ticks
            activity.touch()
            activity.touch()
            await ticks.tick()
        assert scheduler.renewed == ["lease-1"]
        await ticks.tick()  # outputs stopped: the next tick renews
        await ticks.tick()
        assert scheduler.renewed == ["lease-1"] * 3
        activity.touch()
        await ticks.tick()
        assert scheduler.renewed == ["lease-1"] * 3
    assert ticks.intervals == [2.5] * 8  # a quarter of the 10 s life, the last wait cancelled


async def test_a_failed_renewal_is_retried_and_a_gone_lease_ends_the_loop():
    scheduler, ticks = RecordingScheduler([Unavailable("scheduler down"), NotFound("lease")]), Ticks()
    async with renewing(scheduler, assignment(), trace.INVALID_SPAN, ticks.sleep):
        await ticks.tick()
        await ticks.tick()
        await ticks.tick()  # the loop has ended: no more calls
        assert scheduler.renewed == ["lease-1", "lease-1"]
        assert ticks.intervals == [2.5, 2.5]


async def test_a_lease_that_never_expires_is_never_renewed():
    scheduler, ticks = RecordingScheduler(), Ticks()
    async with renewing(scheduler, assignment(ttl=0.0), trace.INVALID_SPAN, ticks.sleep) as activity:
        activity.touch()
        await asyncio.sleep(0)
    assert scheduler.renewed == [] and ticks.intervals == []


def test_activity_is_taken_once():
    activity = LeaseActivity()
    assert activity.take() is False
    activity.touch()
    assert activity.take() is True and activity.take() is False
