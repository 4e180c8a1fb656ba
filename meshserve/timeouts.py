"""``wait_for``: an awaitable bounded by a timeout, without losing a cancellation.

Python 3.11's ``asyncio.wait_for`` runs its awaitable as a separate task; when a
cancellation reaches the waiting task in the same loop iteration as that inner
task finishes, it returns the inner result and drops the cancellation (CPython
gh-86296, fixed in 3.12 by reimplementing ``wait_for`` on ``asyncio.timeout``). A
service loop that pings with ``wait_for`` and is then cancelled by ``stop()`` could
so go on running, and the shutdown waiting for it hung for good: a gateway's task
store probe, pinging a store that answers at once, did exactly that in the test
suite. This ``wait_for`` is 3.12's: it awaits in the calling task under
``asyncio.timeout``, so a cancellation is never lost.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` bounded by ``timeout_s`` seconds (None: unbounded).

    Raises:
        TimeoutError (``asyncio.TimeoutError``): ``timeout_s`` passed; ``aw`` was
            cancelled.
        asyncio.CancelledError: the calling task was cancelled (always raised, even when
            ``aw`` finished at the same moment).
    """
    async with asyncio.timeout(timeout_s):
        return await aw


async def poll_until(done: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
    """Checks ``done()`` now and every ``poll_s`` seconds, for at most ``timeout_s``
    seconds (< 0: once); whether it came true."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
