"""KV events carry the one chain: the executor's stored hashes are the gateway's
(no model: a KVCacheManager with events on)."""

from executor.engine.kv_cache_manager import KVCacheManager
from executor.kv_events import KvEventBatcher
from executor.scheduler_link import lease_num_blocks
from meshserve.block_hash import ModelFingerprint, hash_to_bytes, routing_block_hashes
from executor.engine.request import Request
from meshserve.sampling import SamplingParams
from tests.support.engine_steps import make_request

FP = ModelFingerprint("m", "r1")


def cached(kv: KVCacheManager, rid: str, num_tokens: int, first_token: int = 0):
    req = make_request(rid, num_tokens)
    if first_token:
        req = Request(rid, list(range(first_token, first_token + num_tokens)), SamplingParams(max_tokens=4), 0, 0,
                      10_000)
    blocks, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(rid, num_tokens, blocks) is not None
    kv.cache_blocks(req, num_tokens)
    return req


def test_executor_events_match_the_gateway_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, fingerprint=FP, enable_events=True)
    batcher = KvEventBatcher()
    req = cached(kv, "a", 10)              # two full blocks
    b = cached(kv, "b", 14)                 # shares them, adds a third (tokens 8..11)
    batcher.add(kv.block_pool.take_events())
    gateway = routing_block_hashes(req.all_token_ids[:10], 4, "m", "r1")
    assert len(gateway) == 2
    stored, removed = batcher.take()
    assert stored == routing_block_hashes(make_request("b", 14).all_token_ids, 4, "m", "r1")
    assert stored[:2] == gateway and removed == []
    assert stored == [hash_to_bytes(h) for h in kv.block_hashes(b)]   # the engine's own chain, not a translation
    # another revision is another chain
    assert routing_block_hashes(list(range(8)), 4, "m", "r2") != routing_block_hashes(list(range(8)), 4, "m", "r1")


def test_batch_is_the_net_effect_and_snapshot_lists_what_is_cached():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True, fingerprint=FP, enable_events=True)
    batcher = KvEventBatcher()
    cached(kv, "a", 8)                          # blocks 0, 1 cached
    batcher.add(kv.block_pool.take_events())
    first = batcher.take()[0]
    assert len(first) == 2 and batcher.take() == ([], []) and not batcher.pending()
    kv.free("a")
    cached(kv, "c", 12, first_token=50)         # another prompt: its 3 blocks evict a's 2 cached ones
    batcher.add(kv.block_pool.take_events())
    stored, removed = batcher.take()
    assert sorted(removed) == sorted(first)
    assert stored == routing_block_hashes(list(range(50, 62)), 4, "m", "r1")
    assert not set(stored) & set(removed)
    assert batcher.snapshot() == stored and len(batcher) == 3
    assert kv.block_pool.reset_prefix_cache() is False  # c still holds them
    kv.free("c")
    assert kv.block_pool.reset_prefix_cache() is True
    batcher.add(kv.block_pool.take_events())
    assert batcher.take() == ([], stored) and batcher.snapshot() == []


def test_stored_then_removed_in_one_batch_is_only_removed():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=True, fingerprint=FP, enable_events=True)
    batcher = KvEventBatcher()
    cached(kv, "a", 8)
    kv.free("a")
    kv.block_pool.reset_prefix_cache()
    batcher.add(kv.block_pool.take_events())
    stored, removed = batcher.take()
    assert stored == [] and sorted(removed) == sorted(routing_block_hashes(make_request("a", 8).all_token_ids, 4,
                                                                             "m", "r1"))


def test_lease_block_counts_sum_the_requests_of_each_lease():
    """Requests' blocks (their choices already summed by ``AsyncEngine.num_blocks_by_request``)
    mapped to leases; ids are taken as they are, a request without a lease is left out."""
    active = {"r1": "L1", "r2": "L2", "r3": "L2", "x#y": "L3"}
    counts = lease_num_blocks({"r1": 3, "r2": 2, "r3": 4, "x#y": 1, "x": 5, "orphan": 9}, active)
    assert counts == {"L1": 3, "L2": 6, "L3": 1}


def test_link_sends_a_reset_snapshot_then_net_batches_in_bounded_messages():
    from types import SimpleNamespace

    from executor.scheduler_link import LinkConfig, SchedulerLink

    link = SchedulerLink(LinkConfig("sched:1", "e0", "addr:2", max_hashes_per_message=2), SimpleNamespace())
    h = [bytes([i]) * 16 for i in range(5)]
    msgs = [m.kv_events for m in link._kv_messages(h[:3], [], reset=True)]
    assert [(m.reset, list(m.stored), list(m.removed)) for m in msgs] == [
        (True, [], []), (False, h[:2], []), (False, h[2:3], [])]
    msgs = [m.kv_events for m in link._kv_messages([h[4]], h[:3])]
    assert [(m.reset, list(m.stored), list(m.removed)) for m in msgs] == [
        (False, [], h[:2]), (False, [], h[2:3]), (False, [h[4]], [])]
    assert list(link._kv_messages([], [])) == []
