"""The gateway reaches an executor at whatever address it advertises (a pod IP on
Kubernetes, a container name in compose: no certificate made in advance holds them)
and checks its certificate against the role's name, ``executor``
(``gateway.mesh_client.EXECUTOR_TLS_NAME``), over real mutual TLS on loopback.

Found by a review of the deployment: the gateway checked the advertised host, so
every request of a Kubernetes or compose mesh failed UNAVAILABLE ("Hostname
verification") while the executors registered fine."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.mesh_client import GrpcMeshClient
from meshserve.grpc_server import Service, open_channel
from tests.support.tls import role_tls

ADVERTISED_HOST = "127.0.0.2"  # loopback, but in no certificate's SANs


async def health(channel: grpc.aio.Channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)).status


@pytest.fixture
async def server(request):
    """A real TLS server on every interface holding the certificate of role ``request.param``."""
    svc = Service("meshserve.v1.Executor", 0, "0.0.0.0", role_tls(request.param))
    await svc.start()
    await svc.set_serving(True)
    yield f"{ADVERTISED_HOST}:{svc.port}"
    await svc.stop(0)


@pytest.mark.parametrize("server", ["executor"], indirect=True)
async def test_an_executor_is_reached_at_an_address_its_certificate_does_not_name(server):
    async with open_channel(server, role_tls("gateway")) as plain:  # the host checked: refused
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(plain)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    mesh = GrpcMeshClient("127.0.0.1:1", role_tls("gateway"))
    try:
        mesh._executor(server)
        assert await health(mesh._channels[-1]) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await mesh.close()


@pytest.mark.parametrize("server", ["scheduler", "kvstore"], indirect=True)
async def test_a_server_without_the_executors_name_is_refused_at_an_executors_address(server):
    mesh = GrpcMeshClient("127.0.0.1:1", role_tls("gateway"))
    try:
        mesh._executor(server)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(mesh._channels[-1])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await mesh.close()
