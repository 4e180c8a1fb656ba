"""long_prefill_token_threshold: a long prompt prefills in capped chunks, so the steps it
shares with decodes and prefix-cache hits stay short (vLLM v1's rule of the same name)."""

from __future__ import annotations

import pytest

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.request import Request
from meshserve.sampling import SamplingParams
from tests.support.engine_steps import make_request, run_step, shares


def make_scheduler(threshold: int, budget: int = 100, caching: bool = False, num_blocks: int = 64) -> BatchScheduler:
    config = BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                  long_prefill_token_threshold=threshold)
    return BatchScheduler(config, KVCacheManager(num_blocks, 4, enable_caching=caching))


def test_a_long_prompt_prefills_in_chunks_of_the_threshold_beside_whole_short_ones():
    s = make_scheduler(threshold=4)
    s.add_request(make_request("long", 10, max_tokens=2))
    s.add_request(make_request("short", 3, max_tokens=3))
    out, results = run_step(s)
    assert shares(out) == {"long": 4, "short": 3}
    assert [r.request_id for r in results] == ["short"]
    out, _ = run_step(s)  # the decode first, then the running prefill's next chunk
    assert shares(out) == {"short": 1, "long": 4}
    out, results = run_step(s)
    assert shares(out) == {"short": 1, "long": 2}
    assert [r.request_id for r in results] == ["short", "long"]
    assert s.requests["long"].num_computed_tokens == 10
    out, _ = run_step(s)  # short has its 3 tokens; long decodes one token, never capped below 1
    assert shares(out) == {"long": 1}
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 64


def test_the_budget_still_bounds_a_chunk_below_the_threshold():
    s = make_scheduler(threshold=8, budget=5)
    s.add_request(make_request("a", 20, max_tokens=1))
    assert [shares(run_step(s)[0]) for _ in range(4)] == [{"a": 5}, {"a": 5}, {"a": 5}, {"a": 5}]
    assert not s.has_unfinished_requests()


def test_a_lone_request_keeps_the_whole_budget_until_another_arrives():
    s = make_scheduler(threshold=4)
    s.add_request(make_request("a", 30, max_tokens=3))
    assert shares(run_step(s)[0]) == {"a": 30}
    s.add_request(make_request("b", 9, max_tokens=2))
    s.add_request(make_request("c", 9, max_tokens=1))
    assert shares(run_step(s)[0]) == {"a": 1, "b": 4, "c": 4}


def test_zero_means_no_cap():
    s = make_scheduler(threshold=0)
    s.add_request(make_request("a", 40, max_tokens=1))
    out, _ = run_step(s)
    assert shares(out) == {"a": 40}


def test_a_prefix_cache_hit_computes_its_tail_beside_a_capped_unique_prompt():
    """The shared-system-prompt case: a request whose first 8 tokens are cached computes its
    2 new ones in the same step as 4 of a 20-token prompt that shares nothing."""
    s = make_scheduler(threshold=4, caching=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    system = list(range(50, 58))
    s.add_request(Request("first", system + [1, 2], params, 0, 0, 10_000))
    for _ in range(3):
        run_step(s)
    assert not s.has_unfinished_requests()
    s.add_request(Request("unique", list(range(60, 80)), params, 0, 1, 10_000))
    s.add_request(Request("hit", system + [3, 4], params, 0, 2, 10_000))
    out, results = run_step(s)
    assert shares(out) == {"unique": 4, "hit": 2}
    assert s.requests == {"unique": s.requests["unique"]}  # hit got its token and finished
    assert [r.num_cached_tokens for r in results] == [8]
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.num_free_blocks == 64


@pytest.mark.parametrize("kwargs, message", [
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0, got -1"),
    (dict(long_prefill_token_threshold=64, enable_chunked_prefill=False),
     "long_prefill_token_threshold needs chunked prefill"),
])
def test_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchSchedulerConfig(**kwargs)
