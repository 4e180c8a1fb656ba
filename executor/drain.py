"""Graceful stop of an executor (SIGTERM, or a scale-down): drain, then leave.

``drain`` runs before the executor's services stop:

1. health turns NOT_SERVING (probes take it out of rotation) and the scheduler
   link sends ``ExecutorDraining``; the scheduler routes nothing new here and
   answers ``DrainAck``;
2. the executor keeps serving ``Execute``: a request whose lease was assigned
   before the scheduler marked it draining may still be on its way and is run
   here as usual;
3. the scheduler answers ``DrainAck(done=true)`` once no lease assigned here
   remains (every such request finished and was released by its gateway); then,
   and once no ``Execute`` call is in flight, the executor may leave.

All within ``grace_s`` seconds: past it, the stop goes on (what still runs is
cancelled; the orchestrator's own grace period should exceed ``grace_s``).
Without a scheduler link only step 3's second condition is waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshserve.grpc_server import Service
from meshserve.timeouts import wait_for

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the in-flight Execute calls are counted while draining


async def drain(service: Service, servicer, link, grace_s: float) -> bool:
    """Drains the executor (module docstring); True if it emptied within ``grace_s``.

    Args:
        service: the Executor service (its health turns NOT_SERVING).
        servicer: its ``ExecutorServicer`` (``active_leases``: Execute calls in flight).
        link: its ``SchedulerLink``, or None without a scheduler.
        grace_s: the most seconds to wait (>= 0).
    """
    deadline = time.monotonic() + max(0.0, grace_s)
    await service.set_serving(False)
    try:
        if link is not None:
            link.begin_drain(grace_s)
            await wait_for(link.drained.wait(), max(0.0, deadline - time.monotonic()))
        while servicer.active_leases:
            if time.monotonic() >= deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(POLL_S)
    except asyncio.TimeoutError:
        log.warning("drain: %d requests still running after the %.1f s grace period; stopping anyway",
                    len(servicer.active_leases), grace_s)
        return False
    log.info("drained: no request left; stopping")
    return True
