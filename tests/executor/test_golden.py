"""Golden: our engine's greedy tokens equal transformers' generate(), token for token.

16 prompts of 5..600 tokens (raw and chat-templated) go in at once; the token budget
is small, so they batch together and long prompts are chunked. Variants: prefix
caching off; prefix caching on with chunks of 64 and of 16 tokens, run twice on one
engine so the second run is served from the warm cache (the warm run generates 16
tokens, not 64: every one of its decode steps already attends over the whole
prompt's cached KV, and the 48 more steps would repeat the cold run's); a pool so small that
requests are preempted and recomputed (from their own cached blocks when they
survived); prompts capped at 40 tokens a step (``long_prefill_token_threshold``). Every
variant equals the cold single-request reference.
"""

from __future__ import annotations

import pytest

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.sampling import SamplingParams
from tests.support.reference import GOLDEN_MAX_TOKENS, assert_greedy_matches

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=GOLDEN_MAX_TOKENS, temperature=0.0, ignore_eos=True)
WARM_TOKENS = 16
WARM = SamplingParams(max_tokens=WARM_TOKENS, temperature=0.0, ignore_eos=True)
BUDGET = 256


def make_engine(num_blocks: int, budget: int = BUDGET, caching: bool = True) -> LLMEngine:
    """One torch thread, as an executor on a 2-core host runs: decodes in the CPU attention kernel."""
    return LLMEngine(EngineConfig(dtype="float32", num_threads=1,
                                  cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=caching),
                                  batch=BatchSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget)))


def run_engine(num_blocks: int, prompts: list[list[int]], reverse: bool = False, budget: int = BUDGET,
               caching: bool = True, engine: LLMEngine | None = None,
               params: SamplingParams = GREEDY) -> tuple[list[list[int]], LLMEngine]:
    engine = engine or make_engine(num_blocks, budget, caching)
    if reverse:  # longest first: the victims (latest arrivals) are then the short, cheap to recompute
        outputs = engine.generate(prompts[::-1], params)[::-1]
    else:
        outputs = engine.generate(prompts, params)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == num_blocks
    return outputs, engine


def test_golden_batched_and_chunked_prefix_caching_off(golden_prompts, golden_reference):
    assert len(golden_prompts) == 16
    assert min(map(len, golden_prompts)) == 5 and max(map(len, golden_prompts)) > BUDGET  # chunked
    outputs, engine = run_engine(400, golden_prompts, caching=False)
    stats = engine.stats()
    assert stats.num_preemptions == 0 and stats.num_finished == 16
    assert stats.num_joined_running_batch > 0
    assert stats.num_steps < 16 * GOLDEN_MAX_TOKENS // 4  # they ran batched
    assert stats.prefix_cache_hit_tokens == 0 and stats.num_cached_free_blocks == 0
    assert_greedy_matches(outputs, golden_reference)


@pytest.mark.parametrize("budget, num_prompts", [(64, 16), (16, 6)])
def test_golden_prefix_caching_cold_then_warm(golden_prompts, golden_reference, budget, num_prompts):
    prompts, reference = golden_prompts[:num_prompts], golden_reference[:num_prompts]
    engine = make_engine(400, budget)
    cold, _ = run_engine(400, prompts, engine=engine)
    assert_greedy_matches(cold, reference)
    first = engine.stats()
    warm, _ = run_engine(400, prompts, engine=engine, params=WARM)
    assert [len(w) for w in warm] == [WARM_TOKENS] * num_prompts
    assert_greedy_matches(warm, [ref.first(WARM_TOKENS) for ref in reference])
    stats = engine.stats()
    # the warm run finds every full block of every prompt (~all but < 16 tokens each)
    hits = stats.prefix_cache_hit_tokens - first.prefix_cache_hit_tokens
    assert hits == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats.num_prompt_tokens - first.num_prompt_tokens == sum(len(p) for p in prompts) - hits


def test_golden_with_preemption(golden_prompts, golden_reference):
    outputs, engine = run_engine(150, golden_prompts, reverse=True)  # 2400 slots for ~3300 tokens
    assert engine.stats().num_preemptions > 0
    assert_greedy_matches(outputs, golden_reference)


def test_golden_long_prefill_threshold(golden_prompts, golden_reference):
    """Prompts capped at 40 tokens a step (2.5 blocks: chunks end inside a block) while the
    short ones prefill whole beside them."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=400),
                                    batch=BatchSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET,
                                                               long_prefill_token_threshold=40)))
    outputs, _ = run_engine(400, golden_prompts, engine=engine)
    assert_greedy_matches(outputs, golden_reference)
