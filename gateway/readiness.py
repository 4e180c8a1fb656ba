"""The gateway's readiness follows the mesh: SERVING only while the scheduler is
reachable and has at least one executor registered.

The scheduler's grpc.health.v1 answers for ``EXECUTORS_HEALTH_SERVICE`` (SERVING
while an executor is registered; executors that die, wedge or go silent leave
the registry). The gateway polls it every ``poll_s`` seconds and sets its own
health, so a load balancer or a Kubernetes readiness probe on the gateway stops
sending traffic to a mesh that cannot answer (case C24).
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
        poll_s: polling period (seconds).
    """

    def __init__(self, service: Service, scheduler_channel: grpc.aio.Channel, poll_s: float = 0.5):
        self.service = service
        self.poll_s = poll_s
        self._stub = health_pb2_grpc.HealthStub(scheduler_channel)
        self.ready: bool | None = None  # None until the first answer

    async def check(self) -> bool:
        """One poll: asks the scheduler, sets the gateway's health, returns readiness."""
        try:
            resp = await self._stub.Check(health_pb2.HealthCheckRequest(service=EXECUTORS_HEALTH_SERVICE),
                                          timeout=max(self.poll_s, 1.0))
            ready = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ready = False
        if ready != self.ready:
            log.log(logging.INFO if ready else logging.WARNING, "gateway %s",
                    "ready: executors registered" if ready else "not ready: no executor registered or no scheduler")
            self.ready = ready
            await self.service.set_serving(ready)
        return ready

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)
