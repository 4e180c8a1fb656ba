"""Shortest prompts first (``BatchSchedulerConfig.prefill_order`` "shortest", the default): a
step visits the waiting requests of a priority fewest tokens first, so a burst's step completes
as many prompts as its budget holds; a prompt passed over by later arrivals waits at most
MAX_PREFILL_DEFERRALS steps, and a preempted request goes first."""

from __future__ import annotations

import pytest

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.prefill_order import MAX_PREFILL_DEFERRALS, insert_preempted, shortest_first
from executor.engine.request import Request, RequestStatus
from meshserve.sampling import SamplingParams
from tests.support.engine_steps import finish_all, make_request, run_step, shares

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_scheduler(order: str = "shortest", budget: int = 100, short: int = 0, num_blocks: int = 64,
                   max_num_seqs: int = 8, caching: bool = False) -> BatchScheduler:
    config = BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  short_prefill_tokens=short, prefill_order=order)
    return BatchScheduler(config, KVCacheManager(num_blocks, 4, enable_caching=caching))


def add_burst(s: BatchScheduler, lengths: dict[str, int], max_tokens: int = 1) -> None:
    for rid, n in lengths.items():
        s.add_request(make_request(rid, n, max_tokens=max_tokens))


BURST = {"a": 60, "b": 20, "c": 30, "d": 40, "e": 10}


def test_a_burst_step_completes_the_shortest_prompts_its_budget_holds():
    s = make_scheduler()
    add_burst(s, BURST)
    out, results = run_step(s)
    assert shares(out) == {"e": 10, "b": 20, "c": 30, "d": 40}
    assert [r.request_id for r in results] == ["e", "b", "c", "d"]  # four first tokens, not two
    assert s.requests["a"].status == RequestStatus.WAITING
    assert s.requests["a"].num_prefill_deferrals == 1
    assert finish_all(s) == [{"a": 60}]


def test_arrival_order_takes_the_same_burst_first_come_first_served():
    s = make_scheduler("arrival")
    add_burst(s, BURST)
    out, results = run_step(s)
    assert shares(out) == {"a": 60, "b": 20, "c": 20}  # c's prompt chunked to the budget's end
    assert [r.request_id for r in results] == ["a", "b"]
    assert finish_all(s) == [{"c": 10, "d": 40, "e": 10}]


def test_the_step_budget_left_over_chunks_the_next_shortest_prompt():
    s = make_scheduler(budget=50)
    add_burst(s, BURST)
    assert [shares(run_step(s)[0]) for _ in range(2)] == [{"e": 10, "b": 20, "c": 20}, {"c": 10, "d": 40}]
    assert finish_all(s) == [{"a": 50}, {"a": 10}]


def one_prompt_a_step(s: BatchScheduler, num_steps: int, length: int) -> list[dict[str, int]]:
    """Adds a ``length``-token prompt ``late{i}`` before each of ``num_steps`` steps; their shares."""
    steps = []
    for i in range(num_steps):
        s.add_request(make_request(f"late{i}", length, max_tokens=1))
        steps.append(shares(run_step(s)[0]))
    return steps


def test_a_prompt_passed_by_later_shorter_ones_goes_first_after_the_bound():
    s = make_scheduler(budget=10)
    s.add_request(make_request("long", 11, max_tokens=1))
    steps = one_prompt_a_step(s, MAX_PREFILL_DEFERRALS + 1, 10)
    assert steps == [{f"late{i}": 10} for i in range(MAX_PREFILL_DEFERRALS)] + [{"long": 10}]
    assert s.requests["long"].num_prefill_deferrals == MAX_PREFILL_DEFERRALS
    assert finish_all(s) == [{"long": 1, f"late{MAX_PREFILL_DEFERRALS}": 9}, {f"late{MAX_PREFILL_DEFERRALS}": 1}]


def test_prompts_out_of_passes_go_first_in_arrival_order():
    s = make_scheduler(budget=10)
    s.add_request(make_request("first", 12, max_tokens=1))
    s.add_request(make_request("second", 11, max_tokens=1))
    steps = one_prompt_a_step(s, MAX_PREFILL_DEFERRALS + 2, 10)
    assert steps[MAX_PREFILL_DEFERRALS:] == [{"first": 10}, {"first": 2, "second": 8}]
    assert finish_all(s)[0] == {"second": 3, f"late{MAX_PREFILL_DEFERRALS}": 7}


@pytest.mark.parametrize("order,expected", [("shortest", {"hit": 3, "unique": 7}), ("arrival", {"unique": 10})])
def test_a_prefix_cache_hit_counts_only_its_uncached_tail(order, expected):
    s = make_scheduler(order, budget=10, caching=True)
    prefix = list(range(100, 116))  # four blocks of 4
    s.add_request(Request("warm", prefix + [1, 2], ONE, 0, 0, 10_000))
    finish_all(s)
    s.add_request(Request("unique", list(range(200, 212)), ONE, 0, 1, 10_000))
    s.add_request(Request("hit", prefix + [3, 4, 5], ONE, 0, 2, 10_000))  # 19 tokens, 16 of them cached
    assert shares(run_step(s)[0]) == expected
    finish_all(s)


def test_a_request_preempted_for_a_higher_one_is_not_passed_by_a_later_shorter_one_in_that_step():
    """Found by breaking it: the victim went back to waiting but not into the step's order, so
    a later 3-token prompt of its priority took the blocks it freed, a pass no deferral counted
    (repeated, the victim never finished)."""
    s = make_scheduler(budget=16, num_blocks=6, max_num_seqs=3)
    s.add_request(make_request("long", 20, max_tokens=1))
    assert shares(run_step(s)[0]) == {"long": 16}
    s.add_request(make_request("high", 8, max_tokens=1, priority=1))  # needs 2 blocks, 1 is free
    s.add_request(make_request("late", 3, max_tokens=1, priority=0))
    out, _ = run_step(s)
    assert out.preempted_request_ids == ["long"]
    assert shares(out) == {"high": 8, "long": 8}  # long first again, ahead of late, as in arrival order
    assert finish_all(s) == [{"long": 12, "late": 3}]


def test_insert_preempted_puts_the_victim_after_higher_priorities_and_earlier_first_ones():
    reqs = {rid: make_request(rid, n, priority=p) for rid, n, p in
            (("high", 50, 1), ("early-first", 40, 0), ("short", 5, 0), ("victim", 30, 0), ("low", 2, -1))}
    for i, r in enumerate(reqs.values()):
        r.arrival = i
    reqs["early-first"].num_prefill_deferrals = MAX_PREFILL_DEFERRALS
    reqs["victim"].num_preemptions = 1
    order = [reqs[rid] for rid in ("high", "early-first", "short", "low")]
    insert_preempted(order, reqs["victim"])
    assert [r.request_id for r in order] == ["high", "early-first", "victim", "short", "low"]
    assert [r.request_id for r in shortest_first(list(reqs.values()))] == [r.request_id for r in order]


def test_a_higher_priority_prompt_goes_first_however_long():
    s = make_scheduler(budget=40)
    s.add_request(make_request("short-low", 5, max_tokens=1, priority=0))
    s.add_request(make_request("long-high", 40, max_tokens=1, priority=1))
    assert finish_all(s) == [{"long-high": 40}, {"short-low": 5}]


def test_a_preempted_request_goes_before_shorter_new_ones():
    s = make_scheduler(budget=100, num_blocks=6)
    s.add_request(make_request("low", 8, max_tokens=8, priority=0))  # 2 blocks, a third to decode
    s.add_request(make_request("high", 12, max_tokens=5, priority=1))  # 3 blocks, a 4th to decode
    run_step(s)
    s.add_request(make_request("new", 4, max_tokens=1, priority=0))
    out, _ = run_step(s)  # high needs its 4th block: low is preempted
    assert out.preempted_request_ids == ["low"]
    assert [r.request_id for r in shortest_first(s.waiting)] == ["low", "new"]


def test_shortest_first_orders_by_priority_then_first_ones_then_length_then_arrival():
    reqs = [make_request("long", 30, priority=0), make_request("mid", 20, priority=0),
            make_request("tie", 20, priority=0), make_request("high", 50, priority=2),
            make_request("bounded", 40, priority=0)]
    for i, r in enumerate(reqs):
        r.arrival = i
    reqs[4].num_prefill_deferrals = MAX_PREFILL_DEFERRALS
    assert [r.request_id for r in shortest_first(reqs)] == ["high", "bounded", "mid", "tie", "long"]
    assert [r.request_id for r in reqs] == ["long", "mid", "tie", "high", "bounded"]  # not reordered in place


def test_shortest_first_sorts_only_its_window():
    reqs = [make_request(rid, n) for rid, n in (("a", 30), ("b", 20), ("c", 10), ("d", 5))]
    for i, r in enumerate(reqs):
        r.arrival = i
    assert [r.request_id for r in shortest_first(reqs, window=3)] == ["c", "b", "a", "d"]


@pytest.mark.parametrize("tail", [[1, 2], [], [9]])
def test_the_cached_token_count_is_the_computed_blocks_length(tail):
    """Whole prompt cached ([]): one token is left to compute, so its last block is not counted."""
    s = make_scheduler(caching=True)
    prefix = list(range(100, 116))
    s.add_request(Request("warm", prefix + [7], ONE, 0, 0, 10_000))
    finish_all(s)
    request = Request("probe", prefix + tail, ONE, 0, 1, 10_000)
    blocks, num_hit = s.kv.get_computed_blocks(request)
    assert s.kv.num_cached_tokens(request) == num_hit == {2: 16, 0: 12, 1: 16}[len(tail)]


def test_config_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="prefill_order must be one of shortest, arrival, got 'random'"):
        BatchSchedulerConfig(prefill_order="random")


def test_the_default_is_shortest():
    assert BatchSchedulerConfig().prefill_order == "shortest"
