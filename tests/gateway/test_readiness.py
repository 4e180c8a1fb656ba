"""The gateway's readiness probe (``gateway.readiness.ReadinessProbe``) against a real
gRPC health server standing in for the scheduler's, on loopback (no model): a
definite answer counts at once, a poll that runs out of time only after
``max_misses`` in a row."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.readiness import ReadinessProbe
from meshserve.grpc_server import EXECUTORS_HEALTH_SERVICE, NOT_SERVING, SERVING, Service


class SchedulerHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose Check answers ``status`` for the executors' service, after
    ``delay_s`` seconds (a scheduler too busy to answer in time)."""

    def __init__(self):
        super().__init__()
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.delay_s = 0.0
        self.calls = 0

    async def Check(self, request, context):
        self.calls += 1
        assert request.service == EXECUTORS_HEALTH_SERVICE
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


@pytest.fixture
async def mesh():
    """(the scheduler's health servicer, its server, a started gateway Service, a probe)."""
    servicer = SchedulerHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gateway = Service("meshserve.v1.Gateway", 0)
    await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    probe = ReadinessProbe(gateway, channel, poll_s=0.5, max_misses=3)
    yield servicer, server, gateway, probe
    await channel.close()
    await gateway.stop(0)
    await server.stop(0)


async def gateway_status(gateway: Service) -> int:
    """The gateway's own grpc.health.v1 status ("" service), asked over its port."""
    async with grpc.aio.insecure_channel(gateway.address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return resp.status


async def test_a_slow_scheduler_turns_the_gateway_not_ready_only_after_three_missed_polls_in_a_row(mesh):
    servicer, _, gateway, probe = mesh
    assert await probe.check() is True
    assert await gateway_status(gateway) == SERVING
    servicer.delay_s = 3.0  # each poll gives up after max(poll_s, 1) = 1 s
    assert [await probe.check() for _ in range(2)] == [True, True]
    assert (probe.misses, probe.ready, await gateway_status(gateway)) == (2, True, SERVING)
    assert await probe.check() is False
    assert (probe.misses, probe.ready, await gateway_status(gateway)) == (3, False, NOT_SERVING)
    servicer.delay_s = 0.0
    assert await probe.check() is True
    assert (probe.misses, await gateway_status(gateway)) == (0, SERVING)


async def test_an_answer_between_misses_starts_the_count_again(mesh):
    servicer, _, gateway, probe = mesh
    assert await probe.check() is True
    for _ in range(3):
        servicer.delay_s = 3.0
        assert [await probe.check() for _ in range(2)] == [True, True]
        servicer.delay_s = 0.0
        assert await probe.check() is True
        assert probe.misses == 0
    assert await gateway_status(gateway) == SERVING


async def test_no_executor_turns_the_gateway_not_ready_at_the_first_answer(mesh):
    servicer, _, gateway, probe = mesh
    assert await probe.check() is True
    servicer.status = health_pb2.HealthCheckResponse.NOT_SERVING
    assert await probe.check() is False
    assert await gateway_status(gateway) == NOT_SERVING


async def test_a_scheduler_that_is_gone_turns_the_gateway_not_ready_at_the_first_poll(mesh):
    """A refused connection is UNAVAILABLE, a definite answer: no misses counted."""
    _, server, gateway, probe = mesh
    assert await probe.check() is True
    await server.stop(0)
    assert await probe.check() is False
    assert (probe.misses, await gateway_status(gateway)) == (0, NOT_SERVING)


async def test_a_miss_before_the_first_answer_leaves_the_gateway_not_ready(mesh):
    servicer, _, gateway, probe = mesh
    servicer.delay_s = 3.0
    assert await probe.check() is False
    assert (probe.ready, probe.misses, await gateway_status(gateway)) == (False, 1, NOT_SERVING)


async def test_max_misses_below_one_is_refused():
    with pytest.raises(ValueError, match="max_misses must be >= 1, got 0"):
        ReadinessProbe(None, grpc.aio.insecure_channel("127.0.0.1:1"), max_misses=0)
