"""grpc.health.v1 whose ``Watch`` streams end when the server begins a graceful stop.

grpcio-health-checking's asyncio servicer keeps a ``Watch`` open for ever, even
after ``enter_graceful_shutdown``, so one watcher (a gRPC client with health
checking, a mesh sidecar) would hold ``server.stop(grace)`` for the whole grace
with nothing in flight. Here every watcher is sent the NOT_SERVING of the
shutdown, then its stream ends (status OK); a Watch opened after that gets
NOT_SERVING and ends at once. A watcher writes outside the lock, so a slow one
delays no status change. Everything else is the library's servicer.
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
        self._final = False  # every status is NOT_SERVING for good: watchers end

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super()._set(service, status)
        async with self._condition():
            self._condition().notify_all()

    async def enter_graceful_shutdown(self) -> None:
        # the library sets its flag (set() is ignored from now on), then every status
        # NOT_SERVING through _set; only then may watchers end: none ends on a status it was
        # about to lose
        await super().enter_graceful_shutdown()
        async with self._condition():
            self._final = True
            self._condition().notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:  # noqa: N802 - gRPC's name
        last = None
        while True:
            async with self._condition():
                while True:
                    status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last or self._final:
                        break
                    await self._condition().wait()
            if status == last:  # final, and the watcher has it
                return
            await context.write(health_pb2.HealthCheckResponse(status=status))
            last = status
