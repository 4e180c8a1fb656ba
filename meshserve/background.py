"""One asyncio task a service object runs in the background, started and stopped
with the service (the scheduler link, the step watchdog, the gateway's readiness
probe)."""

from __future__ import annotations

import asyncio


class BackgroundTask:
    """Runs ``self._run()`` as a task between ``start()`` and ``stop()``.

    Subclasses define ``async def _run(self)``; ``stop()`` cancels it and waits
    for it to end (any exception it ended with is swallowed: it is shutting down).
    """

    _task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts ``_run`` in the running event loop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Cancels the task and waits for it (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
            self._task = None

    async def _run(self) -> None:
        raise NotImplementedError
