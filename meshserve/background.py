"""One asyncio task a service object runs in the background, started and stopped
with the service (the scheduler link, the step watchdog, the gateway's readiness
probe)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

RECANCEL_S = 5.0  # how long stop() waits on a cancelled task before cancelling it again


class BackgroundTask:
    """Runs ``self._run()`` as a task between ``start()`` and ``stop()``.

    Subclasses define ``async def _run(self)``; ``stop()`` cancels it and waits
    for it to end (any exception it ended with is swallowed: it is shutting down).
    A task still running ``RECANCEL_S`` seconds after a cancel is cancelled again
    (logged as a warning), so a loop that swallowed a cancellation, as Python 3.11's
    ``asyncio.wait_for`` can (``meshserve.timeouts``), cannot hang a shutdown.
    """

    _task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts ``_run`` in the running event loop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Cancels the task and waits for it (idempotent)."""
        task = self._task
        if task is None:
            return
        task.cancel()
        while not (await asyncio.wait({task}, timeout=RECANCEL_S))[0]:
            log.warning("%s still runs %.3g s after a cancel: cancelling it again", type(self).__name__, RECANCEL_S)
            task.cancel()
        if not task.cancelled():
            task.exception()  # retrieved: it is shutting down
        self._task = None

    async def _run(self) -> None:
        raise NotImplementedError
