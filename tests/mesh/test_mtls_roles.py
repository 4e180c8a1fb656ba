"""The shared test mesh runs over mutual TLS: only the gateway role may run a request
on an executor, the public gateway port takes callers without a client certificate,
and malformed bytes to the gateway and the executor are INVALID_ARGUMENT."""

from __future__ import annotations

import logging

import grpc
import pytest

from meshserve.client import build_request, channel, generate
from meshserve.grpc_server import open_channel
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.support.tls import cert_dir, role_tls

pytestmark = pytest.mark.model

GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"


def execute_request(request_id: str) -> executor_pb2.ExecuteRequest:
    req = executor_pb2.ExecuteRequest(request_id=request_id, prompt_token_ids=[1, 2, 3, 4])
    req.sampling.CopyFrom(common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    return req


@pytest.mark.parametrize("role", ["executor", "client", "scheduler", "kvstore"])
async def test_only_the_gateway_role_may_execute(mesh, role):
    """Case C35: Executor.Execute from any role but gateway (e.g. an executor-role
    certificate) is PERMISSION_DENIED and the executor's work counters do not move."""
    assert mesh.secure
    before = await mesh.executor_stats()
    async with channel(mesh.executors[0][0].address, role_tls(role)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in executor_pb2_grpc.ExecutorStub(ch).Execute(execute_request(f"as-{role}"))]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    after = await mesh.executor_stats()
    assert (after.num_joined_running_batch, after.num_finished, after.num_steps) == (
        before.num_joined_running_batch, before.num_finished, before.num_steps)


async def test_the_gateway_port_serves_tls_callers_without_a_client_certificate(mesh):
    """The public port: TLS that trusts the CA, no client certificate, answers (the API
    key authenticates); plaintext to it fails the handshake."""
    from meshserve.v1 import gateway_pb2_grpc

    async with channel(mesh.gateway.address, TLSConfig(ca=str(cert_dir() / "ca.pem"))) as ch:
        out = await generate(gateway_pb2_grpc.GatewayStub(ch), build_request("Hi", max_tokens=2, temperature=0))
    assert len(out.token_ids) == 2
    async with channel(mesh.gateway.address, PLAINTEXT) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(gateway_pb2_grpc.GatewayStub(ch), build_request("Hi", max_tokens=2), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("target,method,role", [
    ("gateway", "/meshserve.v1.Gateway/Generate", "client"),
    ("gateway", "/meshserve.v1.Gateway/GetTask", "client"),
    ("executor", "/meshserve.v1.Executor/Execute", "gateway"),
    ("executor", "/meshserve.v1.Executor/Stats", "client"),
])
async def test_malformed_bytes_to_the_gateway_and_executor_are_invalid_argument(mesh, target, method, role, caplog):
    """Raw bytes that are no protobuf message: INVALID_ARGUMENT, one warning line and
    no traceback; the executor runs nothing."""
    address = mesh.gateway.address if target == "gateway" else mesh.executors[0][0].address
    before = await mesh.executor_stats()
    caplog.set_level(logging.WARNING)
    async with open_channel(address, role_tls(role)) as ch:
        streaming = method.endswith(("Generate", "Execute"))
        multi = (ch.unary_stream if streaming else ch.unary_unary)(method)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call = multi(GARBAGE, timeout=30)
            _ = [m async for m in call] if streaming else await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.name, r.exc_info) for r in records] == [("meshserve.authz", None)]
    assert (await mesh.executor_stats()).num_joined_running_batch == before.num_joined_running_batch
