"""A tenant's tokens_per_min over the real mesh: the tokens generated for a stream
the caller closed mid-way are charged at release, so leaving early does not make a
completion free (the gateway reports them in ``ReleaseRequest.num_generated_tokens``)."""

from __future__ import annotations

import grpc
import pytest

from meshserve.client import build_request
from scheduler.config import SchedulerConfig
from scheduler.tenant_limits import TenantLimits
from tests.support.engines import make_engine
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh, wait_for_condition

TOKENS_PER_MIN = 60
PROMPT = [(7 * i) % 500 + 40 for i in range(20)]
READ_TOKENS = 30


async def test_a_stream_closed_mid_way_is_charged_for_its_generated_tokens(tokenizer):
    now = [1000.0]  # the scheduler's clock stands still: no refill during the test
    config = SchedulerConfig(tenant_limits={"default": TenantLimits(tokens_per_min=TOKENS_PER_MIN)},
                             executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S)
    mesh = await start_local_mesh([make_engine()], tokenizer, scheduler_config=config,
                                  scheduler_clock=lambda: now[0])
    core = mesh.scheduler.servicer.core
    try:
        call = mesh.stub.Generate(build_request(PROMPT, max_tokens=50, temperature=0.0, ignore_eos=True))
        read = 0
        async for msg in call:
            if msg.WhichOneof("kind") == "delta":
                read += len(msg.delta.token_ids)
                if read >= READ_TOKENS:
                    break
        call.cancel()  # the caller goes away mid-stream
        await wait_for_condition(lambda: core.num_leases() == 0, what="the closed stream's lease released")
        _, bucket = core.rates._buckets("default", now[0])
        generated = TOKENS_PER_MIN - len(PROMPT) - bucket.level
        assert read <= generated <= 50  # what the gateway had read when it closed, at most max_tokens
        with pytest.raises(grpc.aio.AioRpcError) as info:  # 20 prompt tokens no longer fit the bucket
            async for _ in mesh.stub.Generate(build_request(PROMPT, max_tokens=1, temperature=0.0)):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over its rate limit of 60 tokens/min" in info.value.details()
        engine = mesh.engines[0]
        await wait_for_condition(lambda: engine.stats().num_free_blocks == engine.num_blocks,
                                 what="every block back")
    finally:
        await mesh.stop()
