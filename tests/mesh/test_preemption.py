"""Case C20: preemption keeps outputs exact, through the whole mesh."""

import asyncio

import pytest
import pytest_asyncio

from meshserve.client import build_request, generate, generate_choices
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model

SMALL_POOL_BLOCKS = 48  # one 250-token sequence with its outputs needs 17 blocks of 16


def prompts(num: int, length: int = 250) -> list[list[int]]:
    return [[1000 + (i * 7919 + j * 104729) % 40000 for i in range(length)] for j in range(num)]


@pytest_asyncio.fixture(scope="module")
async def small_pool(tokenizer):
    engine = make_engine(num_blocks=SMALL_POOL_BLOCKS)
    m = await start_local_mesh([engine], tokenizer)
    yield m, engine
    await m.stop()


async def test_preemption_keeps_outputs_exact(small_pool, mesh, default_engine):
    """Case C20 asks for 32 prompts of 250 tokens, n=4, max_tokens 256; on the 2-core CPU this
    runs 2 prompts of 250 tokens, n=4, temperature 1.0, max_tokens 140, logprobs 1 (the
    4 choices share the prompt's 15 full blocks through the prefix cache, so one
    request needs 15 + 4 x 10 = 55 blocks by its end: more than the 48-block pool,
    by more than a block per choice, whatever the order in which they start; a third
    prompt would only add preemptions of the same kind);
    then 4 prompts n=1 greedy (max_tokens 24; 4 x 18 = 72 blocks, more than the pool) on
    the small pool and on the large pool (the shared mesh) must agree token for token;
    both runs are asserted to have preempted."""
    m, engine = small_pool
    ps = prompts(4)
    sampled = await asyncio.gather(*(
        generate_choices(m.stub, build_request(p, max_tokens=140, temperature=1.0, n=4, logprobs=1, ignore_eos=True),
                         timeout=900) for p in ps[:2]))
    for choices in sampled:
        assert [c.index for c in choices] == [0, 1, 2, 3]
        for c in choices:
            assert len(c.token_ids) == 140 and c.finish_reason == "length"
            assert [lp.token_id for lp in c.logprobs] == c.token_ids and all(len(lp.top) == 1 for lp in c.logprobs)
    preemptions = engine.stats().num_preemptions
    assert preemptions > 0

    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    small, large = await asyncio.gather(
        asyncio.gather(*(generate(m.stub, build_request(p, **greedy), timeout=600) for p in ps)),
        asyncio.gather(*(generate(mesh.stub, build_request(p, **greedy), timeout=600) for p in ps)))
    assert [s.token_ids for s in small] == [lg.token_ids for lg in large]
    assert engine.stats().num_preemptions > preemptions  # the greedy run was preempted too

    await m.wait_idle()
    await mesh.wait_idle()
    for eng in (engine, default_engine):
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
        eng.check_integrity()
