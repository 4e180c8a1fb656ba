"""The result cache on the shared mesh: two gateways over one Redis share cached
answers; identical requests in flight are computed once across them; the cache is
scoped by tenant (C40) in Redis and in the in-process LRU, shared only where the
tenants file names a common scope; a streaming caller gets a hit as a stream."""

from __future__ import annotations

import asyncio
import re

import pytest
import pytest_asyncio

from gateway.request import ModelInfo
from gateway.result_cache import ResultCache
from gateway.result_store import RedisResultStore
from gateway.server import start_gateway
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, channel, generate
from meshserve.v1 import gateway_pb2_grpc
from tests.support.redis_server import redis_url_or_skip

pytestmark = pytest.mark.model

A, B, C = (("x-api-key", "key-a"),), (("x-api-key", "key-b"),), (("x-api-key", "key-c"),)
TENANTS = """
[[tenants]]
name = "a"
api_keys = ["key-a"]
result_cache_scope = "group-ac"

[[tenants]]
name = "b"
api_keys = ["key-b"]

[[tenants]]
name = "c"
api_keys = ["key-c"]
result_cache_scope = "group-ac"
"""


@pytest.fixture(scope="module")
def redis_url():
    yield from redis_url_or_skip()


@pytest_asyncio.fixture(scope="module")
async def gateways(mesh, tokenizer, redis_url, tmp_path_factory):
    """Two gateways on one Redis result cache, and one with the in-process LRU."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    e0 = mesh.engines[0]
    info = ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision)
    services, stubs, channels = [], [], []
    for cache in (RedisResultStore(redis_url, ttl_s=600), RedisResultStore(redis_url, ttl_s=600),
                  ResultCache(64, ttl_s=600)):
        svc = await start_gateway(tokenizer, info, mesh.scheduler.address, 0, tenants=TenantRegistry.from_file(path),
                                  result_cache=cache, tls=mesh.tls("gateway"))
        services.append(svc)
        channels.append(channel(svc.address, mesh.tls("client")))
        stubs.append(gateway_pb2_grpc.GatewayStub(channels[-1]))
    yield stubs
    for ch, svc in zip(channels, services):
        await ch.close()
        await svc.stop(0.5)
        await svc.servicer.close()


def engine_requests(mesh) -> int:
    s = mesh.executors[0][1].stats()
    return s.num_finished + s.num_aborted


async def test_two_gateways_share_one_cached_answer(mesh, gateways):
    gw1, gw2, _ = gateways
    req = build_request("Name the largest ocean.", max_tokens=8, temperature=0)
    ref = await generate(mesh.stub, req)
    before = engine_requests(mesh)
    first = await generate(gw1, req, A)
    second = await generate(gw2, req, A)
    assert (first.cached, second.cached) == (False, True)
    assert first.token_ids == second.token_ids == ref.token_ids and second.text == ref.text
    assert engine_requests(mesh) == before + 1


async def test_eight_identical_concurrent_requests_run_once(mesh, gateways):
    gw1, gw2, _ = gateways
    req = build_request("Write a haiku about rain.", max_tokens=12, temperature=0, ignore_eos=True)
    before = engine_requests(mesh)
    outs = await asyncio.gather(*(generate(gw, req, A) for gw in (gw1, gw2) * 4))
    assert engine_requests(mesh) == before + 1
    assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) == 12
    assert sorted(o.cached for o in outs) == [False] + [True] * 7


@pytest.mark.parametrize("which", ["redis", "memory"])
async def test_tenant_b_never_reads_tenant_as_cached_answer(mesh, gateways, which):
    """C40: B's identical request is a miss that runs the model and returns the model's
    own output; A's repeat is a hit; C, which shares A's scope in the tenants file, hits."""
    gw = gateways[0] if which == "redis" else gateways[2]
    req = build_request(f"Spell the word {which} backwards.", max_tokens=8, temperature=0)
    ref = await generate(mesh.stub, req)
    before = engine_requests(mesh)
    a = await generate(gw, req, A)
    b = await generate(gw, req, B)
    assert (a.cached, b.cached) == (False, False) and engine_requests(mesh) == before + 2
    assert a.token_ids == b.token_ids == ref.token_ids
    a_again, c = await generate(gw, req, A), await generate(gw, req, C)
    assert (a_again.cached, c.cached) == (True, True) and engine_requests(mesh) == before + 2


async def test_every_output_affecting_field_is_its_own_entry(mesh, gateways, redis_url):
    """C40: each variant of one field is a miss with its own correct output; sampling
    without a seed is never cached; Redis keys reveal neither prompt nor tenant."""
    gw = gateways[0]
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = "Describe a mountain."
    await generate(gw, build_request(prompt, **base), A)
    variants = [dict(base, max_tokens=24), dict(base, stop=["\n"]), dict(base, temperature=0.7, seed=5),
                dict(base, logprobs=2), dict(base, ignore_eos=False)]
    for fields in variants:
        out = await generate(gw, build_request(prompt, **fields), A)
        ref = await generate(mesh.stub, build_request(prompt, **fields))
        assert not out.cached and out.executor_id == "executor-0", fields   # a miss: the model ran it
        assert out.token_ids == ref.token_ids, fields
    unseeded = build_request(prompt, max_tokens=8, temperature=0.7)
    assert [(await generate(gw, unseeded, A)).cached for _ in range(2)] == [False, False]
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    keys = [k.decode() for k in await r.keys("meshserve:rc:*")]
    await r.aclose()
    assert keys and all(re.fullmatch(r"meshserve:rc:[0-9a-f]{64}", k) for k in keys)


async def test_a_streaming_caller_gets_a_cached_answer_as_a_stream(mesh, gateways):
    gw1, gw2, _ = gateways
    req = build_request("Count to five.", max_tokens=10, temperature=0)
    first = await generate(gw1, req, A)
    responses = [r async for r in gw2.Generate(req, metadata=A)]
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds == ["delta", "result"]
    assert list(responses[0].delta.token_ids) == first.token_ids and responses[1].result.cached
