"""A tenant's KV quota bounds each of its requests, not only its admissions: the
scheduler signs into the lease the most tokens a choice may generate within the
quota (``LeaseClaims.max_tokens``), the executor generates no more (finish reason
"length", the same tokens as an unbounded run up to there), and the gateway does
not keep the cut answer in its result cache.

Found by a review: a tenant with ``kv_quota_blocks = 2`` sent a chat with no
``max_tokens``; admission counted its prompt blocks only, and the one request grew
to 365 blocks."""

from __future__ import annotations

import pytest_asyncio

from gateway.request import ModelInfo
from gateway.result_cache import ResultCache
from gateway.server import start_gateway
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, channel, generate_choices
from meshserve.v1 import gateway_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.tenant_limits import TenantLimits
from tests.support.engines import make_engine
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh, wait_for_condition

SMALL = (("x-api-key", "key-small"),)  # a KV quota of 2 blocks of 16 tokens
FREE = (("x-api-key", "key-free"),)    # no quota
PROMPT = [(7 * i) % 500 + 40 for i in range(12)]  # 12 tokens: 2 × 16 - 12 = 20 tokens fit the quota


@pytest_asyncio.fixture(scope="module")
async def quota_mesh(tokenizer, tmp_path_factory):
    tenants_file = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants_file.write_text('[[tenants]]\nname = "small"\napi_keys = ["key-small"]\nkv_quota_blocks = 2\n'
                            '[[tenants]]\nname = "free"\napi_keys = ["key-free"]\n')
    config = SchedulerConfig(tenant_limits={"small": TenantLimits(), "free": TenantLimits()},
                             tenant_quotas={"small": 2}, executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S)
    tenants = TenantRegistry.from_file(tenants_file)
    mesh = await start_local_mesh([make_engine()], tokenizer, tenants=tenants, scheduler_config=config)
    e0 = mesh.engines[0]
    info = ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision)
    cached = await start_gateway(tokenizer, info, mesh.scheduler.address, 0, tenants=tenants,
                                 result_cache=ResultCache(16, ttl_s=600.0), tls=mesh.tls("gateway"))
    yield mesh, cached
    await cached.stop(0.5)
    await cached.servicer.close()
    await mesh.stop()


async def test_a_request_generates_what_its_tenants_quota_holds_and_no_more(quota_mesh):
    mesh, gateway = quota_mesh
    engine = mesh.engines[0]
    assert engine.block_size == 16
    async with channel(gateway.address, mesh.tls("client")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = build_request(PROMPT, max_tokens=50, temperature=0.0, ignore_eos=True)
        (unbounded,) = await generate_choices(stub, request, metadata=FREE)
        (bounded,) = await generate_choices(stub, request, metadata=SMALL)
        assert (len(unbounded.token_ids), unbounded.finish_reason) == (50, "length")
        assert (bounded.token_ids, bounded.finish_reason) == (unbounded.token_ids[:20], "length")
        again = await generate_choices(stub, request, metadata=SMALL)  # the cut answer was not cached
        assert [(c.token_ids, c.cached) for c in again] == [(bounded.token_ids, False)]
        # two choices share the quota: 2 // 2 = 1 block each, 16 - 12 = 4 tokens
        choices = await generate_choices(stub, build_request(PROMPT, max_tokens=50, temperature=0.0,
                                                             ignore_eos=True, n=2, seed=1), metadata=SMALL)
        assert [(len(c.token_ids), c.finish_reason) for c in choices] == [(4, "length"), (4, "length")]
    await wait_for_condition(lambda: engine.stats().num_free_blocks == engine.num_blocks, what="every block back")
    assert mesh.scheduler.servicer.core.quotas.held("small") == 0
