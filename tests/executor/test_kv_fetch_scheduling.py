"""The batch scheduler's side of kvstore fetches, without a model: a request waits
in WAITING_FOR_REMOTE_KVS, fetched blocks extend its local prefix hit into newly
allocated blocks (exact ids in ``kv_loads``), a gap or a late completion means
recompute, and an abort while fetching holds nothing."""

from __future__ import annotations

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.request import ExternalKV, RequestStatus
from tests.support.engine_steps import make_request, run_step, shares


def make_scheduler(num_blocks=32, block_size=4, budget=64):
    config = BatchSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget)
    s = BatchScheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=True))
    s.newly_cached_blocks = []
    return s


def test_fetched_blocks_skip_prefill_and_are_loaded_into_new_blocks():
    s = make_scheduler()
    r = make_request("r", 18)               # 4 full blocks + 2 tokens; at most 4 blocks of hits
    s.add_fetching(r, deadline=1e9)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out, results = run_step(s)
    assert out.is_empty and results == [] and s.has_unfinished_requests()
    assert s.finish_fetch("r", ExternalKV(0, [b"p0", b"p1", b"p2"]))
    out, results = run_step(s)
    assert shares(out) == {"r": 6} and out.scheduled[0].num_computed_tokens == 12
    assert out.kv_loads == [(0, b"p0"), (1, b"p1"), (2, b"p2")]
    assert s.kv.get_block_ids("r") == [0, 1, 2, 3, 4]
    assert (r.num_cached_tokens, r.num_kvstore_tokens, s.kvstore_hit_tokens) == (12, 12, 12)
    assert results[0].num_kvstore_tokens == 12 and results[0].num_cached_tokens == 12
    # every full block got registered, loaded ones included (they hold valid K/V now)
    assert [(req.request_id, block_id) for req, block_id, _ in s.newly_cached_blocks] == [
        ("r", 0), ("r", 1), ("r", 2), ("r", 3)]
    assert s.prefix_cache_hit_tokens == 0   # local hits only


def test_fetched_blocks_continue_a_local_hit_and_are_capped():
    s = make_scheduler()
    first = make_request("a", 9)             # caches blocks 0, 1 locally
    s.add_request(first)
    run_step(s)
    s.abort_request("a")
    r = make_request("r", 12)                # 3 full blocks; at most 2 blocks of hits (keep the last token)
    s.add_fetching(r, deadline=1e9)
    s.finish_fetch("r", ExternalKV(1, [b"p1", b"p2"]))  # fetched from block 1: block 2 would be the third
    out, _ = run_step(s)
    assert out.kv_loads == [] and shares(out) == {"r": 4}  # 2 local blocks, the cap leaves nothing to load
    assert (r.num_cached_tokens, r.num_kvstore_tokens) == (8, 0)

    g = make_request("g", 24)                # same tokens: r's 3 computed blocks are a local hit
    s.add_fetching(g, deadline=1e9)
    s.finish_fetch("g", ExternalKV(4, [b"p4"]))  # the local hit ends at block 3: a gap, nothing usable
    out, _ = run_step(s)
    assert out.kv_loads == [] and out.scheduled[-1].num_computed_tokens == 12
    s.kv.check_integrity()

    s = make_scheduler()
    s.add_request(make_request("a", 13))     # caches blocks 0-2 here
    run_step(s)
    h = make_request("h", 24)
    s.add_fetching(h, deadline=1e9)
    s.finish_fetch("h", ExternalKV(2, [b"p2", b"p3", b"p4"]))  # overlaps the local hit by one block
    out, _ = run_step(s)
    assert [p for _, p in out.kv_loads] == [b"p3", b"p4"] and out.scheduled[-1].num_computed_tokens == 20
    assert (h.num_cached_tokens, h.num_kvstore_tokens) == (20, 8)
    assert [b for b, _ in out.kv_loads] == s.kv.get_block_ids("h")[3:5]
    s.kv.check_integrity()


def test_late_and_expired_fetches_and_aborts():
    s = make_scheduler()
    r = make_request("r", 10)
    s.add_fetching(r, deadline=5.0)
    assert s.expired_fetches(4.9) == [] and s.expired_fetches(5.0) == ["r"]
    assert s.finish_fetch("r", None)         # given up: recomputes
    assert not s.finish_fetch("r", ExternalKV(0, [b"late"]))  # the late completion is ignored
    out, _ = run_step(s)
    assert shares(out) == {"r": 10} and out.kv_loads == []
    q = make_request("q", 10)
    s.add_fetching(q, deadline=1e9)
    assert s.abort_request("q") and "q" not in s.fetching and q.status == RequestStatus.FINISHED_ABORTED
    assert not s.finish_fetch("q", ExternalKV(0, [b"x"]))
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    s.kv.check_integrity()
