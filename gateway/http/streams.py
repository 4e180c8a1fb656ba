"""How the HTTP adapter drives the core's event streams.

* ``merge``: the events of several requests (one per prompt of a completions
  request) as one stream of ``(prompt index, event)``; an error of one ends all.
* ``EventPump``: runs them in a task of its own, read item by item; the adapter
  awaits the first item before it answers, so that an error before it (a bad
  request, an unknown model, the scheduler's 429 or 503) is answered with its
  HTTP status instead of a stream that fails.
* ``until_disconnect``: awaits a coroutine unless the client disconnects first,
  in which case it is cancelled and the adapter cancels the pump (so the core
  cancels the executor call: the engine frees the request's KV blocks, the
  lease is released). A streamed response gets the same from Starlette's
  ``StreamingResponse``, which stops the body iterator when the client
  disconnects; the iterator then cancels the pump.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from starlette.requests import Request

from gateway.events import Event

T = TypeVar("T")
_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


async def merge(streams: Sequence[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """``(i, event)`` of every stream as they come; closing it closes every stream.

    Raises:
        Exception: the first error of any stream (the others are then closed).
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for event in only:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Event]) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put((i, event))
            await queue.put((i, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventPump:
    """Runs the merged core streams in a task of its own and hands their items over a
    bounded queue.

    Why a task of its own: the core cleans up in ``finally`` blocks that await (the
    lease's release). Starlette stops a streamed response inside an anyio cancel
    scope, which cancels *every* await in it until it exits, so the core's
    cleanup must not run inside it; a plain asyncio task is cancelled once and
    cleans up. The queue is bounded (``maxsize`` items), so a slow HTTP reader
    slows the executor's stream as a slow gRPC reader does.
    """

    def __init__(self, streams: Sequence[AsyncIterator[Event]], maxsize: int = 64,
                 on_done: Callable[[], None] | None = None):
        """``on_done()`` is called once the task has ended, whatever ended it, after every
        stream it started has cleaned up: it cleans up for a stream never started (a
        generator closed before its first step never runs its ``finally``), as when the
        task is cancelled before it ran."""
        self._queue: asyncio.Queue = asyncio.Queue(maxsize)
        self._task = asyncio.create_task(self._run(streams))
        if on_done is not None:
            self._task.add_done_callback(lambda _task: on_done())

    async def _run(self, streams: Sequence[AsyncIterator[Event]]) -> None:
        try:
            async with aclosing(merge(streams)) as events:
                async for item in events:
                    await self._queue.put(item)
            await self._queue.put(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await self._queue.put(exc)

    async def next(self) -> tuple[int, Event] | None:
        """The next ``(prompt index, event)``; None after the last.

        Raises:
            Exception: what a core stream raised.
        """
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        """Cancels the streams (the core cancels the executor calls and releases the leases)."""
        self._task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled when the client disconnects first.

    Raises:
        ClientDisconnected: the client went away (``work`` was cancelled).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("the client disconnected")
    return task.result()
