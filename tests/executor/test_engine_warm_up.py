"""The engine's start-up warm-up (``EngineConfig.warm_up``, ``LLMEngine.warm_up``): one full
step of prompt tokens through the workers before any request, leaving nothing behind."""

from __future__ import annotations

import pytest

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.sampling import SamplingParams


def _engine(model, warm_up: bool, num_blocks: int = 64, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", num_threads=1, warm_up=warm_up,
                                  cache=CacheConfig(num_blocks=num_blocks),
                                  batch=BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)))


@pytest.mark.model
def test_a_warmed_up_engine_starts_empty_and_answers_as_a_cold_one(small_model):
    """After the warm-up: no step, no forward token, every block free, nothing in the prefix
    cache (a prompt of the warm-up's own token ids hits nothing), and the same greedy tokens
    as an engine that did not warm up."""
    warm, cold = _engine(small_model, True), _engine(small_model, False)
    stats = warm.stats()
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert stats.num_free_blocks == warm.num_blocks == 64
    assert warm.num_forward_tokens == 0 and warm.forward_seconds == 0.0
    prompts = [list(range(128)), [5, 17, 300, 2, 9] * 7, list(range(40, 240))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert warm.generate(prompts, params) == cold.generate(prompts, params)
    stats = warm.stats()
    assert stats.prefix_cache_hit_tokens == 0 and stats.prefix_cache_queried_tokens == 128 + 35 + 200
    assert stats.num_free_blocks == 64


@pytest.mark.model
@pytest.mark.parametrize("num_blocks, max_num_seqs, want", [
    (64, 8, 512),  # the step budget: 4 prompts of 128
    (20, 8, 320),  # the cache's 20 blocks of 16: prompts of 128, 128 and 64
    (64, 2, 512),  # two prompts of 256: the batch's sequences
])
def test_the_warm_up_runs_one_step_of_the_budget_within_the_cache_and_the_batch(small_model, num_blocks,
                                                                                max_num_seqs, want):
    engine = _engine(small_model, False, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    tokens, seconds = engine.warm_up()
    assert tokens == want and seconds > 0
    assert engine.stats().num_free_blocks == num_blocks
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0]) == 2


def test_the_executors_cli_and_the_benchs_engine_warm_up():
    from meshserve.cli.processes import engine_config

    config = engine_config(model="default", dtype="float32", max_model_len=None, block_size=16,
                           kv_cache_memory="64MiB", max_num_seqs=8, max_num_batched_tokens=512,
                           no_chunked_prefill=False, num_threads=1)
    assert config.warm_up and not EngineConfig().warm_up
