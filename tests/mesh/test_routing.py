"""Prefix-aware routing through the mesh: the executors' KV events and the gateway's prompt
hashes agree, and a repeated prompt goes back to the executor that caches it."""

import asyncio

import pytest
import pytest_asyncio

from meshserve.block_hash import routing_block_hashes
from meshserve.client import build_request, generate
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model


@pytest_asyncio.fixture(scope="module")
async def two_executors(tokenizer):
    engines = [make_engine(), make_engine()]
    m = await start_local_mesh(engines, tokenizer)
    yield m, engines
    await m.stop()


def prompt(seed: int, length: int = 300) -> list[int]:
    return [1000 + (i * 7919 + seed * 104729) % 40000 for i in range(length)]


async def _until(predicate, timeout_s: float = 120.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def test_repeated_prompts_go_back_to_the_executor_holding_their_prefix(two_executors):
    m, engines = two_executors
    index = m.scheduler.servicer.core.prefix_index
    a, b = prompt(1), prompt(2)
    greedy = dict(max_tokens=2, temperature=0.0, ignore_eos=True)
    first_a, first_b = await asyncio.gather(generate(m.stub, build_request(a, **greedy), timeout=300),
                                            generate(m.stub, build_request(b, **greedy), timeout=300))
    assert {first_a.executor_id, first_b.executor_id} == {"executor-0", "executor-1"}  # load spreads them
    # the gateway's hashes of each prompt (model id + revision, no dtype) are what its executor reported
    fp = engines[0].fingerprint
    for p, first in ((a, first_a), (b, first_b)):
        # salted by the tenant of the leases, as with `--prefix-cache-scope tenant` (the default)
        hashes = routing_block_hashes(p, 16, fp.model_id, fp.revision, cache_salt="default")
        assert len(hashes) == 18  # 300 // 16 full blocks
        await _until(lambda h=hashes, e=first.executor_id: index.hit_blocks(h).get(e) == 18)
    await m.wait_idle()
    # both executors idle and equal: least-loaded would send both repeats to the same executor
    again_a = await generate(m.stub, build_request(a, **greedy), timeout=300)
    again_b = await generate(m.stub, build_request(b, **greedy), timeout=300)
    assert (again_a.executor_id, again_b.executor_id) == (first_a.executor_id, first_b.executor_id)
    assert again_a.usage["cached_tokens"] == again_b.usage["cached_tokens"] == 288
    assert again_a.token_ids == first_a.token_ids and again_b.token_ids == first_b.token_ids
