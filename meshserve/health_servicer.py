"""grpc.health.v1 whose ``Watch`` streams end when the server begins a graceful stop.

grpcio-health-checking's asyncio servicer keeps a ``Watch`` open for ever, even
after ``enter_graceful_shutdown``, so one watcher (a gRPC client with health
checking, a mesh sidecar) would hold ``server.stop(grace)`` for the whole grace
with nothing in flight. Here a watcher is sent the NOT_SERVING of the shutdown,
then its stream ends (status OK); a Watch opened after that gets NOT_SERVING and
ends at once. Everything else is the library's servicer.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer


class DrainingHealthServicer(HealthServicer):
    """``HealthServicer`` whose ``Watch`` ends after the shutdown's NOT_SERVING."""

    def __init__(self) -> None:
        super().__init__()
        self._changed: asyncio.Condition | None = None  # made in the serving loop, on first use

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super()._set(service, status)
        async with self._condition():
            self._condition().notify_all()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        async with self._condition():  # also when no status was ever set
            self._condition().notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:  # noqa: N802 - gRPC's name
        last = None
        async with self._condition():
            while True:
                status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                if self._gracefully_shutting_down:
                    return
                await self._condition().wait()
