"""A ``meshserve gateway`` process dialling a test mesh's scheduler (mutual TLS, as
the shared mesh runs), with a gRPC stub of it: the durable-task and Redis-outage
tests run gateways as real processes so that they can be killed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from meshserve.client import channel
from meshserve.grpc_server import wait_serving
from meshserve.v1 import gateway_pb2_grpc
from tests.support.redis_server import free_port
from tests.support.tls import role_tls


def tls_flags(role: str) -> list[str]:
    t = role_tls(role)
    return ["--tls-cert", t.cert, "--tls-key", t.key, "--tls-ca", t.ca]


class GatewayProcess:
    """One ``meshserve gateway`` process (task store ``redis_url``, given in its
    environment as ``meshserve up`` gives it; task lease ``lease_s``) and a stub of it;
    ``extra``: more flags."""

    def __init__(self, scheduler: str, redis_url: str, log_path, extra: tuple[str, ...] = (), lease_s: float = 2.0):
        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.cli", "gateway", "--scheduler", scheduler, "--port", str(self.port),
             "--task-lease-s", str(lease_s), "--log-level", "warning",
             *tls_flags("gateway"), *extra],  # the shared mesh runs mutual TLS
            stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, MESHSERVE_TASK_STORE=redis_url, PYTHONUNBUFFERED="1"))
        self.channel = channel(f"127.0.0.1:{self.port}", role_tls("client"))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def ready(self) -> GatewayProcess:
        await wait_serving(f"127.0.0.1:{self.port}", 300, tls=role_tls("client"))
        return self

    async def stop(self) -> None:
        await self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        await asyncio.to_thread(self.proc.wait, 60)
        self.log.close()
