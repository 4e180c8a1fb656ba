"""The gateway's readiness follows the mesh: SERVING only while the scheduler is
reachable and has at least one executor registered.

The scheduler's grpc.health.v1 answers for ``EXECUTORS_HEALTH_SERVICE`` (SERVING
while an executor is registered; executors that die, wedge or go silent leave
the registry). The gateway polls it every ``poll_s`` seconds and sets its own
health, so a load balancer or a Kubernetes readiness probe on the gateway stops
sending traffic to a mesh that cannot answer.

A definite answer counts at once: NOT_SERVING (no executor), or a scheduler that
cannot be reached (UNAVAILABLE: refused, reset, no route). A poll that only runs
out of time is a *miss*: a scheduler busy for a moment on a loaded host is not a
mesh that cannot answer, and turning the gateway NOT_SERVING for it would make a
load balancer drop a working gateway until the next poll. So the gateway turns
not ready after ``max_misses`` misses in a row (3: about 4.5 s of a scheduler
that answers nothing, at the 0.5 s period and 1 s timeout), and at once on a
miss before its first answer.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.background import BackgroundTask
from meshserve.grpc_server import EXECUTORS_HEALTH_SERVICE, Service

log = logging.getLogger(__name__)


class ReadinessProbe(BackgroundTask):
    """Polls the scheduler's executors health and mirrors it on ``service``.

    Args:
        service: the Gateway service whose health it sets.
        scheduler_channel: an open channel to the scheduler.
        poll_s: polling period (seconds); one poll waits at most ``max(poll_s, 1)`` s.
        max_misses: polls in a row that run out of time before a ready gateway turns
            not ready (>= 1).

    Raises:
        ValueError: ``max_misses`` < 1.
    """

    def __init__(self, service: Service, scheduler_channel: grpc.aio.Channel, poll_s: float = 0.5,
                 max_misses: int = 3):
        if max_misses < 1:
            raise ValueError(f"max_misses must be >= 1, got {max_misses}")
        self.service = service
        self.poll_s = poll_s
        self.max_misses = max_misses
        self._stub = health_pb2_grpc.HealthStub(scheduler_channel)
        self.ready: bool | None = None  # None until the first answer
        self.misses = 0  # polls in a row that ran out of time

    async def check(self) -> bool:
        """One poll: asks the scheduler, sets the gateway's health, returns readiness
        (a miss within ``max_misses`` keeps the readiness it had)."""
        why = "no executor registered"
        try:
            resp = await self._stub.Check(health_pb2.HealthCheckRequest(service=EXECUTORS_HEALTH_SERVICE),
                                          timeout=max(self.poll_s, 1.0))
            ready = resp.status == health_pb2.HealthCheckResponse.SERVING
            self.misses = 0
        except grpc.aio.AioRpcError as exc:
            ready, why = False, f"the scheduler did not answer ({exc.code().name})"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.misses += 1
                if self.ready and self.misses < self.max_misses:
                    log.info("readiness poll missed (%d of %d in a row before not ready)", self.misses,
                             self.max_misses)
                    return True
            else:
                self.misses = 0
        if ready != self.ready:
            log.log(logging.INFO if ready else logging.WARNING, "gateway %s",
                    "ready: executors registered" if ready else f"not ready: {why}")
            self.ready = ready
            await self.service.set_serving(ready)
        return ready

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)
