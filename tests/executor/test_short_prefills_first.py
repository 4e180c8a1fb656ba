"""Short prefills first: a step takes the prefills with few tokens left (prefix-cache hits'
tails, short prompts) first, and longer prefills of no higher priority sit out that step,
each at most MAX_PREFILL_DEFERRALS steps."""

from __future__ import annotations

import pytest

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.prefill_order import MAX_PREFILL_DEFERRALS
from executor.engine.request import Request, RequestStatus
from meshserve.sampling import SamplingParams
from tests.support.engine_steps import finish_all, make_request, run_step, shares

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(50, 58))  # two blocks of 4


def make_scheduler(short: int, budget: int = 100, caching: bool = False) -> BatchScheduler:
    config = BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, short_prefill_tokens=short)
    return BatchScheduler(config, KVCacheManager(64, 4, enable_caching=caching))


def one_short_a_step(s: BatchScheduler, num_steps: int, length: int, priority: int = 0) -> list[dict[str, int]]:
    """Adds a ``length``-token prompt ``short{i}`` before each of ``num_steps`` steps; their shares."""
    steps = []
    for i in range(num_steps):
        s.add_request(make_request(f"short{i}", length, max_tokens=1, priority=priority))
        steps.append(shares(run_step(s)[0]))
    return steps


def test_a_prefix_cache_hit_gets_a_step_without_the_unique_prompt_that_arrived_first():
    s = make_scheduler(short=4, caching=True)
    s.add_request(Request("first", SYSTEM + [1, 2], ONE, 0, 0, 10_000))
    finish_all(s)
    s.add_request(Request("unique", list(range(60, 80)), ONE, 0, 1, 10_000))
    s.add_request(Request("hit", SYSTEM + [3, 4], ONE, 0, 2, 10_000))
    out, results = run_step(s)
    assert shares(out) == {"hit": 2}
    assert [(r.request_id, r.num_cached_tokens) for r in results] == [("hit", 8)]
    assert s.requests["unique"].status == RequestStatus.WAITING
    assert s.requests["unique"].num_prefill_deferrals == 1
    assert finish_all(s) == [{"unique": 20}]


def test_off_keeps_arrival_order():
    s = make_scheduler(short=0)
    s.add_request(make_request("long", 20, max_tokens=1))
    s.add_request(make_request("short", 3, max_tokens=1))
    assert finish_all(s) == [{"long": 20, "short": 3}]


def test_a_running_prompts_next_chunk_sits_out_while_decodes_run():
    s = make_scheduler(short=4, budget=10)
    s.add_request(make_request("long", 30, max_tokens=1))
    assert shares(run_step(s)[0]) == {"long": 10}
    s.add_request(make_request("short", 3, max_tokens=3))
    assert shares(run_step(s)[0]) == {"short": 3}
    s.add_request(make_request("short2", 3, max_tokens=3))
    assert shares(run_step(s)[0]) == {"short": 1, "short2": 3}
    assert s.requests["long"].num_prefill_deferrals == 2
    assert finish_all(s) == [{"short": 1, "short2": 1, "long": 8}, {"short2": 1, "long": 9}, {"long": 3}]
    assert s.num_finished == 3


def test_a_long_prefill_sits_out_at_most_the_bound():
    s = make_scheduler(short=4)
    s.add_request(make_request("long", 20, max_tokens=1))
    steps = one_short_a_step(s, MAX_PREFILL_DEFERRALS + 1, 3)
    assert steps == [{f"short{i}": 3} for i in range(MAX_PREFILL_DEFERRALS)] + [
        {"long": 20, f"short{MAX_PREFILL_DEFERRALS}": 3}]
    assert not s.has_unfinished_requests()


def test_a_short_request_does_not_take_the_blocks_of_a_long_one_that_sat_out_the_bound():
    s = BatchScheduler(BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, short_prefill_tokens=4),
                       KVCacheManager(8, 4))
    s.add_request(make_request("holder", 12, max_tokens=MAX_PREFILL_DEFERRALS + 3))  # 3 of the 8 blocks, then 4
    run_step(s)
    s.add_request(make_request("long", 20, max_tokens=1))  # needs 5 blocks + 1 for its token
    for i in range(MAX_PREFILL_DEFERRALS):
        s.add_request(make_request(f"short{i}", 3, max_tokens=1))
        assert list(shares(run_step(s)[0])) == ["holder", f"short{i}"]
    s.add_request(make_request("late", 3, max_tokens=1))
    assert shares(run_step(s)[0]) == {"holder": 1}  # long waits for blocks; late may not pass it
    assert finish_all(s)[0] == {"holder": 1}
    assert s.num_finished == MAX_PREFILL_DEFERRALS + 3


def test_no_short_request_passes_a_long_one_of_higher_priority():
    s = make_scheduler(short=4)
    s.add_request(make_request("long", 20, max_tokens=1, priority=1))
    s.add_request(make_request("short", 3, max_tokens=1, priority=0))
    s.add_request(make_request("long-low", 20, max_tokens=1, priority=0))
    assert [list(step) for step in finish_all(s)] == [["long", "short", "long-low"]]


def test_a_running_long_prefill_of_higher_priority_goes_before_a_lower_short_one():
    s = make_scheduler(short=4, budget=12)
    s.add_request(make_request("long-high", 18, max_tokens=1, priority=2))
    assert shares(run_step(s)[0]) == {"long-high": 12}
    s.add_request(make_request("long", 20, max_tokens=1, priority=0))
    s.add_request(make_request("short", 3, max_tokens=1, priority=1))
    assert list(shares(run_step(s)[0]).items()) == [("long-high", 6), ("short", 3), ("long", 3)]
    assert s.requests["long"].num_prefill_deferrals == 0
    assert finish_all(s) == [{"long": 12}, {"long": 5}]


def test_config_rejects_a_negative_limit():
    with pytest.raises(ValueError, match="short_prefill_tokens must be >= 0, got -1"):
        BatchSchedulerConfig(short_prefill_tokens=-1)


def test_a_waiting_long_prefill_counts_its_sit_outs_when_short_ones_fill_the_budget():
    """Each short prompt takes the whole 8-token budget in the first pass, so the second pass
    never reaches the long one: its steps are still counted, and after them it runs."""
    s = make_scheduler(short=8, budget=8)
    s.add_request(make_request("long", 20, max_tokens=1))
    steps = one_short_a_step(s, MAX_PREFILL_DEFERRALS + 3, 8)
    assert steps == [{f"short{i}": 8} for i in range(MAX_PREFILL_DEFERRALS)] + [
        {"long": 8}, {"long": 8}, {"long": 4, "short4": 4}]


def test_a_running_prompt_of_higher_priority_is_not_starved_by_lower_short_ones():
    s = make_scheduler(short=8, budget=8)
    s.add_request(make_request("long", 20, max_tokens=1, priority=5))
    steps = [shares(run_step(s)[0])] + one_short_a_step(s, 3, 8, priority=0)
    assert steps == [{"long": 8}, {"long": 8}, {"long": 4, "short0": 4}, {"short0": 4, "short1": 4}]


def test_a_short_request_does_not_pass_a_higher_priority_one_that_sits_out():
    s = make_scheduler(short=4, budget=12)
    s.add_request(make_request("tail", 14, max_tokens=2, priority=5))
    assert shares(run_step(s)[0]) == {"tail": 12}
    s.add_request(make_request("mid", 20, max_tokens=1, priority=3))
    s.add_request(make_request("low", 3, max_tokens=1, priority=2))
    assert shares(run_step(s)[0]) == {"tail": 2}  # mid sits out for tail's last 2; low may not pass mid
    assert s.requests["mid"].num_prefill_deferrals == 1
    assert finish_all(s) == [{"tail": 1, "mid": 11}, {"mid": 9, "low": 3}]
