"""The planner's loop in the scheduler service: one decision per interval.

Thin: ``PlannerLoop`` feeds ``scheduler.planner.Planner`` the mesh's state from
the admission core (ready executors: registered and not draining; queued
requests and tokens) and calls ``decide`` every ``interval_s``; the decision is
exported as ``meshserve_scheduler_desired_executors`` (``scheduler.metrics``),
which KEDA or an HPA (deploy/k8s) and ``meshserve up --autoscale`` act on. The
servicer reports arrivals, served tokens and cold starts to the planner itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from meshserve.background import BackgroundTask
from scheduler.admission import AdmissionCore
from scheduler.planner import Decision, Planner

log = logging.getLogger(__name__)


def ready_executors(core: AdmissionCore) -> int:
    """Registered executors that are not draining."""
    return sum(not e.draining for e in core.registry)


class PlannerLoop(BackgroundTask):
    """Runs ``tick`` every ``planner.config.interval_s`` seconds of ``clock``."""

    def __init__(self, planner: Planner, core: AdmissionCore, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.planner = planner
        self.core = core
        self.clock = clock
        self.sleep = sleep
        self._forecast_failures: set[str] = set()  # kinds (exception class names) logged already

    def observe(self) -> None:
        """Samples the mesh's state (saturation) now; cheap, called on every dispatch too."""
        now, ready, queued = self.clock(), ready_executors(self.core), len(self.core)
        self.planner.observe(now, ready, queued)
        if queued and not ready and self.planner.wake_from_zero(now, queued) is not None:
            log.info("%d request(s) queued with no executor ready: 1 executor wanted now", queued)

    async def tick(self) -> Decision:
        """One decision now; the forecast (a Holt-Winters fit, up to about a second)
        runs in a worker thread, off the event loop. A forecast that raises is logged
        (once per kind of error) and the decision is taken without it (the reactive
        floor alone)."""
        self.observe()
        history = self.planner.snapshot(self.clock())
        try:
            forecast = await asyncio.to_thread(self.planner.forecast, history)
        except Exception as exc:  # noqa: BLE001 - a failed fit must not stop the reactive floor
            forecast = None
            kind = type(exc).__name__
            if kind not in self._forecast_failures:
                self._forecast_failures.add(kind)
                log.warning("planner forecast failed (%s: %s); deciding on the reactive floor alone, "
                            "further %s failures not logged", kind, exc, kind, exc_info=exc)
        self.observe()
        queued_tokens = sum(r.queued_tokens for r in self.core.queued())
        return self.planner.decide(self.clock(), queued_tokens, forecast)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a bad decision must not stop the next ones
                log.exception("planner decision failed; the last desired count stays")
            await self.sleep(self.planner.config.interval_s)
