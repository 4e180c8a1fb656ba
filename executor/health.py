"""The executor's health watchdog: grpc.health.v1 tells the truth about the engine.

A dead engine thread (``AsyncEngine.on_failure``) takes the executor out at
once: NOT_SERVING, link closed. The watchdog also covers a *wedged* engine: a
step that has run longer than ``step_timeout_s`` (a hung kernel, a deadlock, a
stalled device). Then the executor turns NOT_SERVING, leaves the scheduler (its
link closes, so nothing more is routed here), and ends its in-flight requests with
UNAVAILABLE instead of letting callers hang. When the step finally returns, the
executor is SERVING again and re-registers. A rank of a parallel worker group
that dies takes the executor out at once too (``worker_failed``). Like vLLM's
``VLLM_ENGINE_ITERATION_TIMEOUT_S``, the bound is per engine step, in seconds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from meshserve.background import BackgroundTask
from meshserve.timeouts import wait_for

if TYPE_CHECKING:
    from executor.engine.async_engine import AsyncEngine
    from meshserve.grpc_server import Service

log = logging.getLogger(__name__)


class SchedulerLinkLike(Protocol):
    """What the watchdog needs of the executor's scheduler link (``executor.scheduler_link.SchedulerLink``):
    leave the scheduler, register again, and know when it is registered."""

    connected: asyncio.Event

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class StepWatchdog(BackgroundTask):
    """Polls the engine's current step time every ``poll_s`` seconds.

    Args:
        engine: the engine to watch.
        service: the Executor service whose health it sets.
        link: the scheduler link to close while wedged and reopen after (or None).
        step_timeout_s: a step running longer than this is wedged (seconds, > 0).
        poll_s: polling period (seconds).

    Raises:
        ValueError: ``step_timeout_s`` or ``poll_s`` is not positive.
    """

    def __init__(self, engine: AsyncEngine, service: Service, link: SchedulerLinkLike | None,
                 step_timeout_s: float, poll_s: float = 0.25):
        if not step_timeout_s > 0 or not poll_s > 0:
            raise ValueError(f"step_timeout_s and poll_s must be > 0, got {step_timeout_s}, {poll_s}")
        self.engine = engine
        self.service = service
        self.link = link
        self.step_timeout_s = step_timeout_s
        self.poll_s = poll_s
        self.wedged = False
        self.num_wedged = 0  # times the engine was found wedged
        engine.on_failure(lambda exc: asyncio.ensure_future(
            self._take_out(f"engine thread died ({type(exc).__name__}: {exc})")))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if self.engine.failure is not None:
                return  # dead, not wedged: the on_failure callback took the executor out
            running_s = self.engine.step_running_s()
            if not self.wedged and running_s > self.step_timeout_s:
                self.wedged = True
                self.num_wedged += 1
                await self._leave(running_s)
            elif self.wedged and running_s <= self.step_timeout_s:
                self.wedged = False
                await self._rejoin()

    def worker_failed(self, reason: str) -> None:
        """A rank of the worker group died (called in the event loop): NOT_SERVING, off the
        scheduler, and every open request ends with UNAVAILABLE now, without waiting for
        the engine's next step (which fails too: the group is unusable)."""
        self.engine.fail_requests(f"a worker rank failed: {reason}; retry")
        asyncio.ensure_future(self._take_out(f"worker rank failed ({reason})"))

    async def _take_out(self, reason: str) -> None:
        """NOT_SERVING and off the scheduler (it drops this executor at once)."""
        log.error("%s: NOT_SERVING, leaving the scheduler", reason)
        await self.service.set_serving(False)
        if self.link is not None:
            await self.link.stop()

    async def _leave(self, running_s: float) -> None:
        await self._take_out(f"engine step running for {running_s:.1f} s (> {self.step_timeout_s:g} s)")
        self.engine.fail_requests(f"engine step has run for {running_s:.1f} s (step timeout "
                                  f"{self.step_timeout_s:g} s); retry")

    async def _rejoin(self) -> None:
        log.warning("engine steps again: SERVING, registering with the scheduler")
        if self.link is not None:
            self.link.start()
            try:
                await wait_for(self.link.connected.wait(), 30)
            except asyncio.TimeoutError:  # the link keeps retrying on its own
                log.error("scheduler did not accept the re-registration within 30 s")
        await self.service.set_serving(True)
