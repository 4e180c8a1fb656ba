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

All within ``grace_s`` seconds: past it, the stop goes on (the orchestrator's own
grace period should exceed ``grace_s``). What still runs then is ended by the
executor itself, before its server stops: each ``Execute`` call ends UNAVAILABLE
with ``grace_ran_out_message`` (the gateway passes it on, naming the executor;
a caller or the task runner may retry), and the engine aborts its request, which
frees its blocks; the gateway then releases its lease. Without that, the
server's own stop would cancel the calls with gRPC's bare "Cancelling all calls".
Without a scheduler link only step 3's second condition is waited for.

Once the drain has ended, either way, an ``Execute`` that still arrives (a late
retry with a lease from before the drain) is refused at once, UNAVAILABLE with
``DRAINED_MESSAGE`` or ``grace_ran_out_message``: it would otherwise start a
request that the server's stop cancels moments later.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshserve.grpc_server import Service
from meshserve.timeouts import poll_until, wait_for

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the in-flight Execute calls are counted while draining
END_WAIT_S = 5.0  # how long the calls ended at the grace's end get to send their status (as Service.stop's grace)
DRAINED_MESSAGE = "the executor is stopping (it has drained its requests); the request can be retried"


def grace_ran_out_message(grace_s: float) -> str:
    """The details of the UNAVAILABLE that ends a call still running when the drain
    grace of ``grace_s`` seconds ran out."""
    return (f"the executor is stopping and its drain grace of {grace_s:g} s ran out before this request finished; "
            "the request can be retried")


async def drain(service: Service, servicer, link, grace_s: float) -> bool:
    """Drains the executor (module docstring); True if it emptied within ``grace_s``.

    Args:
        service: the Executor service (its health turns NOT_SERVING).
        servicer: its ``ExecutorServicer`` (``active_leases``: Execute calls in flight).
        link: its ``SchedulerLink``, or None without a scheduler.
        grace_s: the most seconds to wait (>= 0); past it, the calls still running are
            ended UNAVAILABLE (``grace_ran_out_message``), waiting at most ``END_WAIT_S``
            more for them to end.
    """
    deadline = time.monotonic() + max(0.0, grace_s)
    await service.set_serving(False)
    try:
        if link is not None:
            link.begin_drain(grace_s)
            await wait_for(link.drained.wait(), max(0.0, deadline - time.monotonic()))
        if not await poll_until(lambda: not servicer.active_leases, deadline - time.monotonic(), POLL_S):
            raise asyncio.TimeoutError
    except asyncio.TimeoutError:
        log.warning("drain: %d requests still running after the %.1f s grace period; ending them (UNAVAILABLE) "
                    "and stopping", len(servicer.active_leases), grace_s)
        servicer.refuse_new(grace_ran_out_message(grace_s))
        servicer.engine.fail_requests(grace_ran_out_message(grace_s))
        # each call sends its status and aborts its request
        await poll_until(lambda: not servicer.active_leases, END_WAIT_S, POLL_S)
        return False
    servicer.refuse_new(DRAINED_MESSAGE)
    log.info("drained: no request left; stopping")
    return True
