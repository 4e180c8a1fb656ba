"""What every service's server shares: keepalive settings of clients and servers agree,
so long-lived streams (an executor's Connect, a slow token stream) are never cut with
GOAWAY too_many_pings; an idle service stops at once, whatever its grace period."""

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.grpc_server import (CHANNEL_OPTIONS, LIVENESS_SERVICE, NOT_SERVING, SERVER_OPTIONS, SERVING, Service,
                                   open_channel)
from meshserve.metrics import new_registry


def test_server_accepts_the_clients_ping_rate():
    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


def _refused(address: str) -> bool:
    """Nothing listens at ``address`` (host:port) any more."""
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


async def test_an_idle_service_stops_without_waiting_out_its_grace_period():
    """A stop with an hour of grace ends at once when no call is in flight, even with a
    client connected and a health ``Watch`` stream open (it ends with the stop); the
    gRPC, health and metrics ports are closed after. The 60 s bound only catches a hang."""
    service = Service("meshserve.v1.Scheduler", 0, health_port=0)
    service.serve_metrics(new_registry("scheduler"), 0)
    await service.start()
    async with open_channel(service.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
        assert (await watch.read()).status == SERVING
        await asyncio.wait_for(service.stop(grace_s=3600), 60)
        assert (await watch.read()).status == NOT_SERVING
        assert await watch.read() is grpc.aio.EOF
        assert await watch.code() == grpc.StatusCode.OK
    assert _refused(service.address) and _refused(service.health_address) and _refused(service.metrics.address)
