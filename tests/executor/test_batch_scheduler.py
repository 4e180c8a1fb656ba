"""BatchScheduler without a model: token shares, block ids, statuses, preemption."""

from __future__ import annotations

import random

import pytest

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.request import RequestStatus
from tests.support.engine_steps import make_request, run_step, shares


def make_scheduler(num_blocks=100, block_size=4, budget=10, max_num_seqs=4, chunked=True, eos=frozenset(),
                   caching=False, max_batch_wait_ms=0.0, prefill_order="shortest"):
    config = BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  enable_chunked_prefill=chunked, max_batch_wait_ms=max_batch_wait_ms,
                                  prefill_order=prefill_order)
    return BatchScheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching), eos)


def test_chunked_prefill_shares_and_block_ids():
    s = make_scheduler(budget=10)
    a, b = make_request("a", 7), make_request("b", 15)
    s.add_request(a)
    s.add_request(b)

    out, results = run_step(s)
    assert shares(out) == {"a": 7, "b": 3}
    assert [x.sample for x in out.scheduled] == [True, False]
    assert out.scheduled[1].token_ids == [0, 1, 2] and out.scheduled[1].num_computed_tokens == 0
    assert s.kv.get_block_ids("a") == [0, 1] and s.kv.get_block_ids("b") == [2]
    assert [(r.request_id, r.new_token_ids, r.finished) for r in results] == [("a", [7], False)]

    out, _ = run_step(s)  # decode of a first, then b's next chunk with the rest of the budget
    assert shares(out) == {"a": 1, "b": 9}
    assert out.scheduled[1].num_computed_tokens == 3
    assert s.kv.get_block_ids("b") == [2, 3, 4]

    out, results = run_step(s)
    assert shares(out) == {"a": 1, "b": 3}
    assert s.kv.get_block_ids("a") == [0, 1, 5] and s.kv.get_block_ids("b") == [2, 3, 4, 6]
    assert [r.request_id for r in results] == ["a", "b"]
    assert (a.num_computed_tokens, a.num_tokens, b.num_computed_tokens, b.num_tokens) == (9, 10, 15, 16)
    assert a.status == b.status == RequestStatus.RUNNING


def test_chunked_prefill_off_waits_for_whole_prompt():
    s = make_scheduler(budget=10, chunked=False)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6))
    out, _ = run_step(s)
    assert shares(out) == {"a": 6}
    assert s.requests["b"].status == RequestStatus.WAITING
    out, _ = run_step(s)
    assert shares(out) == {"a": 1, "b": 6}


def test_max_num_seqs_and_joined_running_batch():
    s = make_scheduler(budget=100, max_num_seqs=2)
    for name in "abc":
        s.add_request(make_request(name, 3, max_tokens=2))
    out, _ = run_step(s)
    assert shares(out) == {"a": 3, "b": 3}
    assert s.num_joined_running_batch == 0  # the batch was empty
    out, results = run_step(s)  # a and b finish (max_tokens 2), c still waits for a seat
    assert shares(out) == {"a": 1, "b": 1}
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", "length"), ("b", "length")]
    out, _ = run_step(s)
    assert shares(out) == {"c": 3}
    assert out.finished_request_ids == {"a", "b"}
    assert s.num_joined_running_batch == 0
    s.add_request(make_request("d", 2, max_tokens=2))
    out, _ = run_step(s)
    assert shares(out) == {"c": 1, "d": 2}
    assert s.num_joined_running_batch == 1  # d joined c's running batch


def test_preemption_victim_is_lowest_priority_then_latest_arrival():
    s = make_scheduler(num_blocks=6, block_size=4, budget=100, prefill_order="arrival")
    a = make_request("a", 8, max_tokens=6)
    b = make_request("b", 8, max_tokens=7, priority=1)
    c = make_request("c", 7, max_tokens=6)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["b", "a", "c"]  # priority, then arrival (not length)
    assert (s.kv.get_block_ids("b"), s.kv.get_block_ids("a"), s.kv.get_block_ids("c")) == ([0, 1], [2, 3], [4, 5])

    out, _ = run_step(s)  # b needs a 3rd block: c (priority 0, latest) is preempted
    assert out.preempted_request_ids == ["c"]
    assert shares(out) == {"b": 1, "a": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [7]  # kept: recomputed with the prompt later
    assert s.kv.get_block_ids("b") == [0, 1, 5] and s.kv.get_block_ids("a") == [2, 3, 4]
    assert s.kv.num_free_blocks == 0

    for _ in range(3):
        out, _ = run_step(s)
        assert shares(out) == {"b": 1, "a": 1} and not out.preempted_request_ids
    out, _ = run_step(s)  # 13th token: b needs a 4th block, a (priority 0) goes
    assert out.preempted_request_ids == ["a"]
    assert shares(out) == {"b": 1}
    assert s.kv.get_block_ids("b") == [0, 1, 5, 4]
    assert [r.request_id for r in s.waiting] == ["a", "c"]

    out, results = run_step(s)  # b's 7th token: finished; a and c come back after
    assert [(r.request_id, r.finish_reason) for r in results] == [("b", "length")]
    out, _ = run_step(s)
    assert shares(out) == {"a": 13, "c": 8}  # recompute prompt + outputs
    assert [x.sample for x in out.scheduled] == [True, True]
    assert [x.block_ids for x in out.scheduled] == [[3, 2, 4, 5], [1, 0]]
    _drain(s)
    assert a.output_token_ids == [7] * 6 and c.output_token_ids == [7] * 6
    assert s.num_preemptions == 2 and s.kv.num_free_blocks == 6


def test_preempting_a_request_scheduled_earlier_in_the_step_unschedules_it():
    # l (priority 0) decodes; h (priority 1) is mid-prefill and needs l's blocks.
    s = make_scheduler(num_blocks=4, block_size=4, budget=5)
    low = make_request("l", 4, max_tokens=8)
    s.add_request(low)
    run_step(s)
    high = make_request("h", 12, max_tokens=2, priority=1)
    s.add_request(high)
    out, _ = run_step(s)
    assert shares(out) == {"l": 1, "h": 4}
    out, _ = run_step(s)
    assert shares(out) == {"l": 1, "h": 4}
    assert s.kv.get_block_ids("l") == [0, 1] and s.kv.get_block_ids("h") == [2, 3]
    out, results = run_step(s)  # l's decode was scheduled first, then preempted for h's last chunk
    assert out.preempted_request_ids == ["l"] and shares(out) == {"h": 4}
    assert out.num_scheduled_tokens == 4 and [r.request_id for r in results] == ["h"]
    assert s.kv.get_block_ids("h") == [2, 3, 1]
    assert low.status == RequestStatus.PREEMPTED and low.output_token_ids == [7, 7, 7]
    _drain(s)
    assert low.output_token_ids == [7] * 8 and s.kv.num_free_blocks == 4


def test_a_request_that_is_itself_the_lowest_preempts_itself():
    s = make_scheduler(num_blocks=4, block_size=4, budget=100)
    b = make_request("b", 4, max_tokens=8, priority=1)
    s.add_request(b)
    run_step(s)
    a = make_request("a", 8, max_tokens=2)
    s.add_request(a)
    out, _ = run_step(s)
    assert shares(out) == {"b": 1, "a": 8}
    out, _ = run_step(s)  # a's decode needs a 3rd block; a is the lowest: it goes, b keeps its blocks
    assert out.preempted_request_ids == ["a"] and shares(out) == {"b": 1}
    assert s.kv.get_block_ids("b") == [0, 1]
    _drain(s)
    assert a.output_token_ids == [7, 7] and s.kv.num_free_blocks == 4


def test_stop_conditions():
    s = make_scheduler(budget=100, eos=frozenset({7}))
    s.add_request(make_request("eos", 3, ignore_eos=False))
    s.add_request(make_request("stop-id", 3, stop_token_ids=(7,)))
    s.add_request(make_request("len", 3, max_len=5))
    req = make_request("max-tokens", 3, max_tokens=2)
    s.add_request(req)
    _, results = run_step(s)
    assert {r.request_id: r.finish_reason for r in results} == {"eos": "stop", "stop-id": "stop", "len": None,
                                                                "max-tokens": None}
    _, results = run_step(s)
    assert {r.request_id: r.finish_reason for r in results} == {"len": "length", "max-tokens": "length"}
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 100
    assert s.num_finished == 4


def test_abort_frees_blocks_at_once():
    s = make_scheduler(budget=100)
    s.add_request(make_request("a", 9))
    s.add_request(make_request("w", 9))
    run_step(s)
    assert s.kv.num_free_blocks == 100 - 6
    assert s.abort_request("a") and s.abort_request("w")
    assert not s.abort_request("a") and not s.abort_request("nope")
    assert s.kv.num_free_blocks == 100 and s.num_aborted == 2 and s.num_finished == 2
    out, _ = run_step(s)
    assert out.is_empty and out.finished_request_ids == {"a", "w"}


@pytest.mark.parametrize("caching", [False, True])
def test_random_workloads_never_deadlock_and_return_every_block(caching):
    rng = random.Random(1234)
    for trial in range(20):
        num_blocks = rng.randint(8, 24)
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=rng.choice([4, 8, 32]),
                           max_num_seqs=rng.randint(1, 6), chunked=True, caching=caching)
        capacity = num_blocks * 4
        reqs = []
        for i in range(rng.randint(1, 10)):  # prompts 0, 1, 2, ... share their beginnings
            reqs.append(make_request(f"{trial}-{i}", rng.randint(1, capacity - 1), max_tokens=rng.randint(1, 12),
                                     priority=rng.randint(0, 2), max_len=capacity))
            s.add_request(reqs[-1])
            if rng.random() < 0.3:
                run_step(s)  # later arrivals meet running and cached requests
        _drain(s, limit=5000)
        for r in reqs:
            assert r.status.finished
            assert len(r.output_token_ids) == min(r.sampling_params.max_tokens, capacity - r.num_prompt_tokens)
        assert s.kv.num_free_blocks == num_blocks
        assert s.kv.req_to_blocks == {} and s.kv.req_to_block_hashes == {}
        if not caching:
            assert s.prefix_cache_hit_tokens == 0 and s.kv.block_pool.num_evictable_blocks == 0


def test_prefix_hit_starts_after_cached_blocks_and_preempted_request_finds_its_own_blocks():
    s = make_scheduler(num_blocks=6, block_size=4, budget=100, caching=True)
    a = make_request("a", 10, max_tokens=2)
    s.add_request(a)
    _drain(s)
    assert s.kv.block_pool.num_evictable_blocks == 2  # a's blocks 0-3 and 4-7 (8-11 never filled)
    b = make_request("b", 10, max_tokens=3)
    s.add_request(b)
    out, _ = run_step(s)
    assert shares(out) == {"b": 2} and out.scheduled[0].num_computed_tokens == 8
    assert out.scheduled[0].token_ids == [8, 9] and out.scheduled[0].block_ids[:2] == [0, 1]
    assert b.num_cached_tokens == 8
    assert (s.prefix_cache_queried_tokens, s.prefix_cache_hit_tokens) == (20, 8)
    assert s.num_prompt_tokens == 10 + 2
    # a higher-priority request takes b's blocks; b recomputes from its own cached blocks
    h = make_request("h", 17, max_tokens=1, priority=1)
    h.prompt_token_ids[:] = h.all_token_ids[:] = [50 + i for i in range(17)]
    s.add_request(h)
    out, _ = run_step(s)
    assert out.preempted_request_ids == ["b"] and shares(out) == {"h": 17}
    # b was freed last block first (3, 1, 0), so h's 5 blocks took the plain ones and then
    # evicted block 1; b's first block (tokens 0-3) survived and b recomputes 11 - 4 tokens
    assert out.scheduled[0].block_ids == [4, 5, 2, 3, 1]
    out, _ = run_step(s)
    assert shares(out) == {"b": 7} and out.scheduled[0].num_computed_tokens == 4
    assert out.scheduled[0].block_ids[0] == 0
    assert b.num_cached_tokens == 8  # reported at first scheduling only
    _drain(s)
    assert b.output_token_ids == [7, 7, 7] and s.kv.num_free_blocks == 6


def test_higher_priority_waiting_request_preempts_lower_and_equal_never_does():
    s = make_scheduler(budget=100, max_num_seqs=2)
    low1, low2 = make_request("l1", 4, max_tokens=50), make_request("l2", 4, max_tokens=50)
    s.add_request(low1)
    s.add_request(low2)
    run_step(s)
    s.add_request(make_request("eq", 4, max_tokens=2))
    out, _ = run_step(s)
    assert shares(out) == {"l1": 1, "l2": 1} and not out.preempted_request_ids  # equal priority waits
    high = make_request("h", 5, max_tokens=2, priority=2)
    s.add_request(high)
    out, results = run_step(s)  # l2 (latest) was decoding this step: unscheduled, preempted
    assert out.preempted_request_ids == ["l2"] and shares(out) == {"l1": 1, "h": 5}
    assert [r.request_id for r in results] == ["l1", "h"]  # h's first token in the same step
    assert [r.request_id for r in s.waiting] == ["l2", "eq"]  # l2 arrived before eq
    _drain(s)
    assert high.output_token_ids == [7, 7] and low2.output_token_ids == [7] * 50
    assert s.num_preemptions == 1 and s.kv.num_free_blocks == 100


def test_max_batch_wait_holds_new_prefills_until_full_or_deadline():
    s = make_scheduler(budget=20, max_num_seqs=3, max_batch_wait_ms=50.0)
    now = [100.0]
    s.clock = lambda: now[0]
    s.add_request(make_request("a", 4))
    out, _ = run_step(s)
    assert out.is_empty and s.hold_deadline == pytest.approx(100.05)
    now[0] += 0.049
    assert run_step(s)[0].is_empty
    now[0] += 0.001  # the oldest has waited 50 ms: released, never later
    out, _ = run_step(s)
    assert shares(out) == {"a": 4} and s.hold_deadline is None
    # with a batch running, new prefills are held while there is room, decodes go on
    s.add_request(make_request("b", 4))
    out, _ = run_step(s)
    assert shares(out) == {"a": 1} and s.hold_deadline == pytest.approx(100.1)
    s.add_request(make_request("c", 4))  # running + waiting == max_num_seqs: no reason to wait
    out, _ = run_step(s)
    assert shares(out) == {"a": 1, "b": 4, "c": 4}
    # waiting prompt tokens that fill the budget are released at once
    s2 = make_scheduler(budget=8, max_num_seqs=8, max_batch_wait_ms=1000.0)
    s2.add_request(make_request("x", 4))
    assert run_step(s2)[0].is_empty
    s2.add_request(make_request("y", 4))
    assert shares(run_step(s2)[0]) == {"x": 4, "y": 4}


def _drain(s, limit=1000):
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return
        out, _ = run_step(s)
        assert out.num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(out.scheduled) <= s.config.max_num_seqs
    raise AssertionError("scheduler did not finish: deadlock?")


def test_in_flight_prefix_sharing_defers_to_the_request_computing_it():
    """Three requests share a 12-token prompt (block 4) and arrive together; a
    fourth has its own prompt. Only the first computes the shared blocks; the
    others wait one step (the unrelated one goes ahead) and then hit the cache."""
    s = make_scheduler(num_blocks=40, block_size=4, budget=100, max_num_seqs=8, caching=True)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 12))
    other = make_request("d", 12)
    other.prompt_token_ids[0] = other.all_token_ids[0] = 99  # another first block: nothing shared
    s.add_request(other)

    out, _ = run_step(s)
    assert shares(out) == {"a": 12, "d": 12}
    assert s.num_deferred_for_prefix == 2
    assert s.requests["b"].status == s.requests["c"].status == RequestStatus.WAITING

    out, _ = run_step(s)  # a and d decode; b and c read blocks 0-1 from the cache, compute the last 4 tokens
    assert shares(out) == {"a": 1, "d": 1, "b": 4, "c": 4}
    assert s.requests["b"].num_cached_tokens == s.requests["c"].num_cached_tokens == 8
    assert s.kv.get_block_ids("b")[:2] == s.kv.get_block_ids("a")[:2]
    assert s.prefix_cache_hit_tokens == 16


def test_a_higher_priority_request_waits_for_the_shared_block_before_taking_a_slot():
    """One slot; a low-priority request is computing the block a high-priority one starts
    with. The high one waits a step for it (the low one finishes the block, nobody is
    preempted), then preempts the low one and reads the block from the cache. Before, it
    preempted first, then waited on the victim's block, which the victim, readmitted in
    the same step, restarted from 0: a livelock (found by the property test)."""
    s = make_scheduler(num_blocks=10, block_size=4, budget=3, max_num_seqs=1, caching=True)
    low = make_request("low", 4, max_tokens=3, priority=0)
    s.add_request(low)
    out, _ = run_step(s)
    assert shares(out) == {"low": 3}
    high = make_request("high", 5, max_tokens=2, priority=1)
    high.prompt_token_ids[:4] = high.all_token_ids[:4] = low.prompt_token_ids
    s.add_request(high)

    out, _ = run_step(s)
    assert shares(out) == {"low": 1}
    assert (s.num_deferred_for_prefix, s.num_preemptions) == (1, 0)
    assert high.status == RequestStatus.WAITING and low.num_computed_tokens == 4

    out, _ = run_step(s)
    assert shares(out) == {"high": 1}
    assert (high.num_cached_tokens, s.num_preemptions, low.status) == (4, 1, RequestStatus.PREEMPTED)
    for _ in range(10):
        run_step(s)
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.kv.num_blocks


def test_in_flight_prefix_sharing_off_without_caching():
    s = make_scheduler(num_blocks=40, block_size=4, budget=100, max_num_seqs=8, caching=False)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 12))
    out, _ = run_step(s)
    assert shares(out) == {"a": 12, "b": 12}
    assert s.num_deferred_for_prefix == 0
