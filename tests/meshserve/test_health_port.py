"""The plaintext health-only port (``Service(..., health_port=...)``) over real TLS on
loopback (no model): it answers grpc.health.v1 with the statuses of the mutual-TLS
port, serves nothing else, and starts and stops with the service."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.grpc_server import (EXECUTORS_HEALTH_SERVICE, LIVENESS_SERVICE, NOT_SERVING, SERVING, Service,
                                   open_channel)
from meshserve.tls import PLAINTEXT
from meshserve.v1 import kvstore_pb2, scheduler_pb2
from scheduler.server import start_scheduler
from tests.support.mesh_harness import wait_for_condition
from tests.support.tls import role_tls

REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def mesh_methods() -> list[str]:
    """The full method names of the Scheduler and KVStore services."""
    return [f"/{service.full_name}/{method.name}"
            for module, name in ((scheduler_pb2, "Scheduler"), (kvstore_pb2, "KVStore"))
            for service in [module.DESCRIPTOR.services_by_name[name]] for method in service.methods]


async def check(address: str, tls, service: str = "") -> int:
    """grpc.health.v1 Check of ``service`` at ``address`` over ``tls``; the status (raises on an RPC error)."""
    async with open_channel(address, tls) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return resp.status


@pytest.fixture
async def scheduler():
    svc = await start_scheduler(0, tls=role_tls("scheduler"), health_port=0)
    yield svc
    await svc.stop(0)


async def test_the_health_port_answers_check_in_plaintext_with_the_tls_ports_statuses(scheduler):
    """The scheduler is SERVING at once; with no executor registered its executors'
    status is NOT_SERVING: the same answers on both ports."""
    assert scheduler.health_address != scheduler.address
    for name, expected in (("", SERVING), ("meshserve.v1.Scheduler", SERVING), (EXECUTORS_HEALTH_SERVICE, NOT_SERVING)):
        assert await check(scheduler.health_address, PLAINTEXT, name) == expected
        assert await check(scheduler.address, role_tls("gateway"), name) == expected


async def test_an_unknown_service_name_is_not_found_on_both_ports(scheduler):
    for address, tls in ((scheduler.health_address, PLAINTEXT), (scheduler.address, role_tls("gateway"))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(address, tls, "no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_main_port_still_refuses_plaintext(scheduler):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(scheduler.address, PLAINTEXT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("method", [*mesh_methods(), REFLECTION])
async def test_the_health_port_serves_nothing_but_health(scheduler, method):
    """Every Scheduler and KVStore method, and server reflection: UNIMPLEMENTED there."""
    async with open_channel(scheduler.health_address, PLAINTEXT) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_the_health_port_follows_the_service_from_start_to_stop():
    """NOT_SERVING on both ports until the service turns SERVING, then SERVING on
    both, with liveness SERVING throughout; after stop the health port is gone too."""
    svc = Service("meshserve.v1.KVStore", 0, tls=role_tls("kvstore"), health_port=0)
    await svc.start()
    try:
        for name in ("", "meshserve.v1.KVStore"):
            assert await check(svc.health_address, PLAINTEXT, name) == NOT_SERVING
            assert await check(svc.address, role_tls("executor"), name) == NOT_SERVING
        # liveness (Kubernetes' liveness probes) is SERVING as soon as the service listens, and
        # stays so while it is not ready (a gateway with no executor must not be restarted)
        assert await check(svc.health_address, PLAINTEXT, LIVENESS_SERVICE) == SERVING
        await svc.set_serving(False)
        assert await check(svc.health_address, PLAINTEXT, LIVENESS_SERVICE) == SERVING
        await svc.set_serving()
        for name in ("", "meshserve.v1.KVStore"):
            assert await check(svc.health_address, PLAINTEXT, name) == SERVING
            assert await check(svc.address, role_tls("executor"), name) == SERVING
    finally:
        await svc.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(svc.health_address, PLAINTEXT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_without_a_health_port_there_is_no_second_server():
    svc = Service("meshserve.v1.KVStore", 0, tls=role_tls("kvstore"))
    assert (svc.health_server, svc.health_address) == (None, None)


async def test_a_busy_health_port_is_refused_naming_the_flag():
    """(async: a grpc.aio server is made in the running event loop)"""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError) as err:
            Service("meshserve.v1.KVStore", 0, tls=role_tls("kvstore"), health_port=port)
    assert str(err.value) == (f"meshserve.v1.KVStore: cannot listen on 127.0.0.1:{port} for health (port in use "
                              "or not allowed); choose one with --health-port")


async def _watch(address: str, tls, statuses: list[int], service: str = "") -> grpc.StatusCode:
    """grpc.health.v1 Watch at ``address`` until its stream ends; each status seen is
    appended to ``statuses``; returns the call's final code."""
    async with open_channel(address, tls) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service))
        async for resp in call:
            statuses.append(resp.status)
        return await call.code()


@pytest.mark.parametrize("port", ["tls", "health"])
async def test_watch_follows_the_status_and_ends_at_the_stop_without_holding_the_drain(port):
    """Watch (a client's health checking) streams every change, then, at a stop, the
    shutdown's NOT_SERVING and the end of the stream (OK): it never holds a drain for its
    grace (600 s here: the 60 s bound would catch it). Before, the error interceptor
    answered Watch INTERNAL at once."""
    svc = await start_scheduler(0, tls=role_tls("scheduler"), health_port=0)
    address, tls = ((svc.address, role_tls("gateway")) if port == "tls" else (svc.health_address, PLAINTEXT))
    statuses: list[int] = []
    watch = asyncio.create_task(_watch(address, tls, statuses, EXECUTORS_HEALTH_SERVICE))
    await wait_for_condition(lambda: statuses == [NOT_SERVING], what="the first status")  # no executor yet
    await svc.health.set(EXECUTORS_HEALTH_SERVICE, SERVING)
    await wait_for_condition(lambda: statuses == [NOT_SERVING, SERVING], what="the change")
    await asyncio.wait_for(svc.stop(600.0), 60)
    assert await asyncio.wait_for(watch, 60) == grpc.StatusCode.OK
    assert statuses == [NOT_SERVING, SERVING, NOT_SERVING]
