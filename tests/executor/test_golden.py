"""Golden: our engine's greedy tokens equal transformers' generate(), token for token.

16 prompts of 5..600 tokens (raw and chat-templated) go in at once; the token budget
is small, so they batch together and long prompts are chunked; a second run uses a
pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.sampling import SamplingParams
from tests.executor.conftest import GOLDEN_MAX_TOKENS
from tests.executor.reference import assert_greedy_matches

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=GOLDEN_MAX_TOKENS, temperature=0.0, ignore_eos=True)
BUDGET = 256


def run_engine(num_blocks: int, prompts: list[list[int]], reverse: bool = False) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=num_blocks),
                                    batch=BatchSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET)))
    if reverse:  # longest first: the victims (latest arrivals) are then the short, cheap to recompute
        outputs = engine.generate(prompts[::-1], GREEDY)[::-1]
    else:
        outputs = engine.generate(prompts, GREEDY)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == num_blocks
    return outputs, engine


def test_golden_batched_and_chunked(golden_prompts, golden_reference):
    assert len(golden_prompts) == 16
    assert min(map(len, golden_prompts)) == 5 and max(map(len, golden_prompts)) > BUDGET  # chunked
    outputs, engine = run_engine(400, golden_prompts)
    stats = engine.stats()
    assert stats.num_preemptions == 0 and stats.num_finished == 16
    assert stats.num_joined_running_batch > 0
    assert stats.num_steps < 16 * GOLDEN_MAX_TOKENS // 4  # they ran batched
    assert_greedy_matches(outputs, golden_reference)


def test_golden_with_preemption(golden_prompts, golden_reference):
    outputs, engine = run_engine(150, golden_prompts, reverse=True)  # 2400 slots for ~3300 tokens
    assert engine.stats().num_preemptions > 0
    assert_greedy_matches(outputs, golden_reference)
