"""The requests the gateway's callers are running, and how a stop ends those left.

Each adapter runs the core's event streams of its callers through
``RunningRequests.guard`` (the gRPC ``Generate`` stream; each core stream of an HTTP
completion, streamed or not). Async tasks are not guarded: a stopping gateway hands
them back, or fails them, as ``gateway.task_runner`` says.

A stopping gateway (``gateway.server.stop_gateway``) lets its calls run for its
grace (``RunningRequests.stop``); past it, it ends each request still running
itself, before its servers stop: the request's stream raises ``Unavailable``
(``grace_ran_out_message``), which each adapter answers as it answers an executor's
mid-stream UNAVAILABLE (gRPC status UNAVAILABLE; HTTP 503 with Retry-After, or an
error event then ``[DONE]`` in a started stream), and its core stream is closed
first, as for a caller that went away: the executor call is cancelled (the engine
frees the request's blocks) and the lease is released. Without that, gRPC's own stop
would cancel the calls with its bare "Cancelling all calls" and uvicorn's would cut
the HTTP responses mid-body, logging tracebacks.

How a request is ended depends on where its task waits:

* inside its core stream (the usual case: waiting for the executor's next tokens):
  the task is cancelled, the stream cleans up as for a cancel, and the guard turns
  the cancellation into the error, unless the task was cancelled by its caller too
  (a client gone as the grace ran out): that stays a plain cancel;
* outside it (the adapter is writing to a slow client): the core stream, suspended
  at a ``yield``, is closed from here, and the guard raises the error when the
  adapter asks for the next event.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, TypeVar

from meshserve.errors import Unavailable
from meshserve.timeouts import poll_until

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.05  # how often the requests still running are counted while waiting for them to end
END_WAIT_S = 5.0  # how long the requests ended at the grace's end get to send their error and clean up


def grace_ran_out_message(grace_s: float) -> str:
    """The message of the UNAVAILABLE that ends a request still running when the
    gateway's stop grace of ``grace_s`` seconds ran out."""
    return (f"the gateway is stopping and its grace of {grace_s:g} s ran out before this request finished; "
            "the request can be retried")


async def _close(events: AsyncIterator) -> None:
    """Closes a core stream suspended at a ``yield`` (its caller waits elsewhere)."""
    try:
        await events.aclose()
    except Exception as exc:  # noqa: BLE001 - the stop goes on; the lease expires if its release failed
        log.warning("closing a request ended at the stop failed: %r", exc)


class _Request:
    """One guarded stream: the task iterating it, whether that task waits inside it,
    and, once ended by ``end_all``, the error and the close under way."""

    __slots__ = ("events", "task", "inside", "cancelled", "error", "closing")

    def __init__(self, events: AsyncIterator) -> None:
        self.events = events
        self.task: asyncio.Task | None = None
        self.inside = False
        self.cancelled = False  # end_all cancelled its task, which has not seen it yet
        self.error: BaseException | None = None
        self.closing: asyncio.Task | None = None

    @property
    def ended(self) -> bool:
        """Ended by ``end_all`` and its stream closed (its caller may not have asked again yet)."""
        return self.closing is not None and self.closing.done()


class RunningRequests:
    """The guarded requests of one gateway (see the module docstring)."""

    def __init__(self) -> None:
        self._running: set[_Request] = set()
        self._error: Callable[[], BaseException] | None = None  # set by end_all: later requests end at once

    def __len__(self) -> int:
        """How many requests run and have not been ended."""
        return sum(not r.ended for r in self._running)

    async def guard(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """``events`` (a core stream), closed with it, registered while it runs; once
        ``end_all`` was called it raises that error instead (the stream closed first).

        Raises:
            Exception: what ``events`` raises, or ``end_all``'s error.
        """
        request = _Request(events)
        self._running.add(request)
        try:
            while True:
                if request.error is None and self._error is not None:  # arrived after end_all
                    request.error = self._error()
                if request.error is not None:
                    raise request.error
                request.task, request.inside = asyncio.current_task(), True
                cancelling = request.task.cancelling()  # the cancels already asked of its task, if any
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return
                except BaseException as exc:
                    if not request.cancelled:  # its own error, or the caller went away
                        raise
                    if isinstance(exc, asyncio.CancelledError) and request.task.cancelling() > cancelling + 1:
                        raise  # its caller went away too (before or after end_all): a plain cancel
                    continue  # end_all's cancellation (however the stream ended on it): its error, above
                finally:
                    request.inside = False
                    if request.cancelled:  # delivered: the task is not being cancelled any more
                        request.cancelled = False
                        request.task.uncancel()
                if request.error is None:
                    yield event
        finally:
            self._running.discard(request)
            if request.closing is not None:
                await asyncio.shield(request.closing)
            else:
                await events.aclose()

    def end_all(self, error: Callable[[], BaseException]) -> int:
        """Ends every request running (and any that starts later) with a new
        ``error()`` each; returns how many it ended. Each one's core stream is closed
        (cancelled where its task waits in it), which cancels its executor call and
        releases its lease; its adapter answers the error."""
        self._error = error
        ended = 0
        for request in list(self._running):
            if request.error is not None:
                continue
            request.error = error()
            ended += 1
            if request.inside and request.task is not None:
                request.cancelled = True
                request.task.cancel()
            else:  # suspended at a yield: closed here, raised at its caller's next ask
                request.closing = asyncio.create_task(_close(request.events))
        return ended

    async def wait_ended(self, timeout_s: float) -> bool:
        """Waits at most ``timeout_s`` until no request runs; whether none does."""
        return await poll_until(lambda: not len(self), timeout_s, POLL_S)

    async def stop(self, grace_s: float) -> bool:
        """A stop's part: waits at most ``grace_s`` until no request runs; past it ends
        those left (``end_all``: UNAVAILABLE, ``grace_ran_out_message``) and waits at
        most ``END_WAIT_S`` more for them to end. Whether none was left to end."""
        if await self.wait_ended(grace_s):
            return True
        message = grace_ran_out_message(grace_s)
        log.warning("%d requests still running after the gateway's %.1f s grace; ending them (UNAVAILABLE)",
                    len(self), grace_s)
        self.end_all(lambda: Unavailable(message))
        if not await self.wait_ended(END_WAIT_S):
            log.warning("%d requests ended at the grace's end have not finished within %.0f s; the servers' stop "
                        "cuts them", len(self), END_WAIT_S)
        return False
