"""The default model (9 query heads, 3 KV heads, 30 layers) over 3 tensor-parallel
ranks and over 2 pipeline stages, on gloo: greedy tokens equal to the single-rank
engine's with chunked prefill, prefix caching and preemption at work; KV blocks
saved by the group are the whole-model blocks (the single rank's, within float
noise) and a block loaded into the group comes back byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from executor.engine.llm_engine import LLMEngine
from executor.engine.scheduler_output import BlockSave, SchedulerOutput
from tests.support.parallel import parallel_config, workload

pytestmark = pytest.mark.model

VOCAB = 49152


@pytest.fixture(scope="module")
def single(default_model_files):
    engine = LLMEngine(parallel_config("default", max_model_len=512))
    prompts, params = workload(VOCAB, max_tokens=8)
    outputs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0  # the workload exercises both
    return engine, outputs


@pytest.fixture(scope="module", params=[(3, 1), (1, 2)], ids=["tp3", "pp2"])
def group(request, default_model_files):
    tp, pp = request.param
    engine = LLMEngine(parallel_config("default", tp, max_model_len=512, pipeline_parallel_size=pp))
    yield engine
    engine.shutdown()


def _saves(block_ids: list[int]) -> SchedulerOutput:
    return SchedulerOutput([], 0, kv_saves=[BlockSave(b, b, "probe") for b in block_ids])


def test_group_generates_the_single_rank_tokens(single, group):
    _, expected = single
    prompts, params = workload(VOCAB, max_tokens=8)
    assert group.generate(prompts, params) == expected
    s, g = single[0].stats(), group.stats()
    assert (g.num_preemptions, g.prefix_cache_hit_tokens) == (s.num_preemptions, s.prefix_cache_hit_tokens)
    assert g.num_free_blocks == g.num_blocks == s.num_blocks  # the group's capacity is the engine's


def test_saved_blocks_are_whole_model_blocks_and_loads_round_trip(single, group):
    """Run after the generation above: both caches hold the same prompts in the same blocks."""
    assert group.kv_store_fingerprint == single[0].kv_store_fingerprint  # one namespace for every layout
    ours = group.worker_group.execute_model(_saves([0, 1])).kv_saved
    reference = single[0].worker_group.execute_model(_saves([0, 1])).kv_saved
    assert [len(p) for p in ours] == [len(p) for p in reference] == [group.kv_layout.block_bytes] * 2
    for got, want in zip(ours, reference):
        np.testing.assert_allclose(np.frombuffer(got, np.float32), np.frombuffer(want, np.float32), atol=1e-3)
    free = group.num_blocks - 1  # no request holds it now: a scratch block
    step = SchedulerOutput([], 0, kv_loads=[(free, reference[0])], kv_saves=[BlockSave(free, free, "probe")])
    assert group.worker_group.execute_model(step).kv_saved == [reference[0]]
