"""The readiness of the gateway's task path: SERVING while its task store answers.

The async task API depends on the task store (Redis when shared); synchronous
``Generate`` does not. So the task path has its own grpc.health.v1 service,
``TASKS_HEALTH_SERVICE`` (``meshserve.v1.Gateway.Tasks``), and its own HTTP
readiness route (``GET /ready/tasks``), next to the gateway's overall readiness
(which follows the executors, ``gateway.readiness``). ``TaskStoreProbe`` pings
the store every ``poll_s`` seconds, each ping bounded by ``timeout_s``; while it
fails the task service is NOT_SERVING and ``SubmitTask`` answers UNAVAILABLE at
once (HTTP 503 with ``Retry-After``) instead of waiting on the store.
A store in memory always answers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from meshserve.background import BackgroundTask
from meshserve.timeouts import wait_for

log = logging.getLogger(__name__)

TASKS_HEALTH_SERVICE = "meshserve.v1.Gateway.Tasks"


class TaskStoreProbe(BackgroundTask):
    """Pings ``check`` and reports the outcome through ``report``.

    Args:
        check: one ping of the task store (``TaskStore.check``); raises when it
            cannot be reached.
        report: awaited with True (SERVING) or False (NOT_SERVING) when readiness changes.
        poll_s: the polling period (seconds).
        timeout_s: one ping's bound (seconds); past it the store counts as unreachable.
    """

    def __init__(self, check: Callable[[], Awaitable[None]], report: Callable[[bool], Awaitable[None]],
                 poll_s: float = 0.5, timeout_s: float = 1.0):
        self._check, self._report = check, report
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.ready: bool | None = None  # None until the first ping

    async def check(self) -> bool:
        """One ping; reports a change; returns readiness."""
        try:
            await wait_for(self._check(), self.timeout_s)
            ready, why = True, ""
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            ready, why = False, f"{type(exc).__name__}: {exc}"
        if ready != self.ready:
            if ready:
                log.info("task path ready: the task store answers")
            else:
                log.warning("task path not ready: the task store does not answer (%s)", why)
            self.ready = ready
            await self._report(ready)
        return ready

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)
