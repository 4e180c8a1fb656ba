"""The n > 1 fan-in: the output streams of a request's choices merged into one.

``AsyncEngine.generate_choices`` adds one engine request per choice and hands
their streams here::

    choice 0 stream ──▶ pump 0 ──┐
    choice 1 stream ──▶ pump 1 ──┼──▶ merged (asyncio.Queue, maxsize n) ──▶ (index, output)
    choice 2 stream ──▶ pump 2 ──┘

The merge queue is bounded: a slow reader fills it, the pumps then
wait, and what the engine makes backs up into each choice's own queue, whose
bound (``AsyncEngine.max_buffered_outputs``) ends that choice with
``ResourceExhausted``; the reader gets the error after what was already merged.
A single choice skips the pumps: its stream is read directly.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator, Sequence

from executor.engine.outputs import RequestOutput


async def merge_choices(streams: Sequence[AsyncGenerator[RequestOutput, None]],
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields ``(choice index, output)`` of every stream as they come, until each
    stream gave a ``finished`` output; the index is the stream's position.

    Raises:
        Exception: the first error a stream raised (after the outputs merged before it);
            the other streams are then closed.

    Closing it (or cancelling its consumer) closes every stream, each in its pump
    (which aborts its choice), and returns only once every pump has ended.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as outs:
            async for out in outs:
                yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    tasks = [asyncio.create_task(_pump(index, stream, merged)) for index, stream in enumerate(streams)]
    try:
        unfinished = len(streams)
        while unfinished:
            index, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item.finished
            yield index, item
    finally:
        for task in tasks:  # a cancelled pump closes its stream, which aborts the choice
            task.cancel()
        # every stream is closed before the caller goes on (and frees the request id,
        # so a retry with the same id is not refused as "in use")
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # a no-op, but for a pump cancelled before it started


async def _pump(index: int, stream: AsyncGenerator[RequestOutput, None], merged: asyncio.Queue) -> None:
    """Moves the outputs of choice ``index`` into ``merged``, then its error if any."""
    try:
        # aclosing: a pump cancelled while it waits on ``merged`` closes its stream
        # (aborting the choice) at once, not when the generator is collected
        async with aclosing(stream) as outs:
            async for out in outs:
                await merged.put((index, out))
    except Exception as exc:  # noqa: BLE001 - re-raised by the consumer in merge_choices
        await merged.put((index, exc))
