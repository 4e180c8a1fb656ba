"""The scheduler refusing the gateway itself is the mesh's fault, never the caller's:
a tenant the gateway's tenants file lists and the scheduler's does not, or a gateway
certificate the scheduler does not accept, gives the caller (with a valid key)
UNAVAILABLE naming the scheduler's reason over gRPC, 503 over HTTP, never
PERMISSION_DENIED/403 or UNAUTHENTICATED/401; a task fails UNAVAILABLE after its
attempts; no lease, queued request or block is left, and the refused Admit is not
followed by a Release (the scheduler granted nothing). The scheduler's caller-facing
refusals keep their codes."""

from __future__ import annotations

import logging

import grpc
import httpx2 as httpx
import pytest
import pytest_asyncio

from gateway.generation import GatewayCore
from gateway.mesh import RefusedByMesh
from gateway.mesh_client import GrpcMeshClient
from gateway.request import GenerationRequest, ModelInfo
from gateway.tenants import Tenant, TenantRegistry
from meshserve.client import build_request, generate, submit_task, wait_task
from meshserve.sampling import SamplingParams
from meshserve.v1 import gateway_pb2
from scheduler.config import SchedulerConfig
from scheduler.tenant_limits import TenantLimits
from tests.support.engines import make_engine
from tests.support.http_mesh import KEY_A, KEY_B, KEY_QUOTA, SERVED, write_tenants
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh
from tests.support.tls import role_tls

pytestmark = pytest.mark.model
REFUSED_B = "scheduler refused the call (PERMISSION_DENIED): unknown tenant 'b'"
REQUEST = build_request([5, 6, 7, 8] * 5, max_tokens=2, temperature=0.0, ignore_eos=True)
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest_asyncio.fixture(scope="module")
async def mesh(tokenizer, tmp_path_factory):
    """The gateway's tenants file lists ``a``, ``b`` and ``quota``; the scheduler's lists
    ``a`` and ``quota`` (one KV block) only."""
    registry = TenantRegistry.from_file(write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.toml"))
    config = SchedulerConfig(tenant_limits={"a": TenantLimits(), "quota": TenantLimits()}, tenant_quotas={"quota": 1},
                             executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S)
    m = await start_local_mesh([make_engine(num_blocks=64)], tokenizer, tenants=registry, http=True,
                               served_model_names=(SERVED,), scheduler_config=config)
    yield m
    await m.stop()


async def test_a_tenant_the_scheduler_does_not_list_is_unavailable_over_grpc_and_its_task_fails_so(mesh):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(mesh.stub, REQUEST, metadata=(("x-api-key", KEY_B),), timeout=120)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, REFUSED_B)
    handle = await submit_task(mesh.stub, REQUEST, metadata=(("x-api-key", KEY_B),))
    status = await wait_task(mesh.stub, handle.task_id, metadata=(("x-api-key", KEY_B),), poll_s=0.05, timeout_s=120)
    assert (status.state, status.attempt, status.error.code, status.error.message) == (
        gateway_pb2.TASK_STATE_FAILED, 3, "UNAVAILABLE", REFUSED_B)
    await mesh.wait_released()
    out = await generate(mesh.stub, REQUEST, metadata=(("x-api-key", KEY_A),), timeout=120)  # a listed tenant runs
    assert len(out.token_ids) == 2
    await mesh.wait_released()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_the_scheduler_does_not_list_is_503_over_http(mesh, stream):
    async with httpx.AsyncClient(base_url=mesh.http_url, timeout=120) as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                            headers={"authorization": f"Bearer {KEY_B}"})
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert r.json() == {"error": {"message": REFUSED_B, "type": "service_unavailable_error", "param": None,
                                  "code": "service_unavailable"}}
    await mesh.wait_released()


async def test_the_schedulers_own_refusal_of_a_caller_keeps_its_code(mesh):
    """A prompt over its tenant's KV quota is the caller's: RESOURCE_EXHAUSTED, 429."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(mesh.stub, REQUEST, metadata=(("x-api-key", KEY_QUOTA),), timeout=120)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("scheduler: ")
    async with httpx.AsyncClient(base_url=mesh.http_url, timeout=120) as http:
        r = await http.post("/v1/completions", json={"model": SERVED, "prompt": "Hi " * 40, "max_tokens": 2},
                            headers={"authorization": f"Bearer {KEY_QUOTA}"})
    assert (r.status_code, r.json()["error"]["code"]) == (429, "insufficient_quota")
    await mesh.wait_released()


async def test_a_gateway_certificate_the_scheduler_refuses_is_unavailable_and_sends_no_release(
        mesh, tokenizer, caplog):
    """A gateway holding a client-role certificate: the scheduler's authorization refuses
    its Admit; the core does not follow it with a Release (which would be refused too)."""
    e0 = mesh.engines[0]
    client = GrpcMeshClient(mesh.scheduler.address, role_tls("client"))
    core = GatewayCore(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision), client)
    try:
        request = GenerationRequest(prompt="Hi", request_id="wrong-cert", sampling=SamplingParams(max_tokens=2))
        with caplog.at_level(logging.WARNING, logger="gateway.mesh_client"):
            with pytest.raises(RefusedByMesh) as info:
                [e async for e in core.generate(request, Tenant("a"))]
        assert (info.value.code, str(info.value)) == (
            grpc.StatusCode.UNAVAILABLE, "scheduler refused the call (PERMISSION_DENIED): role client may not call "
            "/meshserve.v1.Scheduler/Admit (allowed: gateway)")
        assert [r.getMessage() for r in caplog.records if r.name == "gateway.mesh_client"] == []
        await mesh.wait_released()
    finally:
        await client.close()
