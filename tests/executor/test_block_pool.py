"""BlockPool and KVCacheManager without a model: exact block ids, reference counts,
LRU eviction, events and the invariant free + evictable + referenced == num_blocks."""

from __future__ import annotations

import pytest

from executor.engine.block_pool import BlockPool, BlockRemoved, BlockStored, NoFreeBlocksError
from executor.engine.kv_cache_manager import KVCacheManager
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_block_tokens, hash_full_blocks
from tests.support.engine_steps import make_request

FP = ModelFingerprint("m", "r1")


def counts(pool: BlockPool) -> tuple[int, int, int]:
    """(free, evictable, referenced), after checking they add up."""
    pool.check_integrity()
    evictable = pool.num_evictable_blocks
    return pool.num_free_blocks - evictable, evictable, pool.num_referenced_blocks


def test_block_pool_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert counts(pool) == (3, 0, 3)
    pool.free([2, 0])
    assert pool.free_block_ids() == [3, 4, 5, 2, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 1, 1, 1, 1]
    assert counts(pool) == (1, 0, 5)


def test_block_pool_refcounts_and_errors():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 2
    pool.free([a])
    assert pool.num_free_blocks == 1  # still held once
    pool.free([a])
    assert pool.free_block_ids() == [1, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert counts(pool) == (2, 0, 0)


def test_cached_blocks_are_evictable_then_evicted_least_recently_freed_first():
    pool = BlockPool(4, enable_events=True)
    ids = pool.allocate(3)                                 # [0, 1, 2]
    h = [hash_block_tokens(FP.root_hash, [1, 2])]
    h.append(hash_block_tokens(h[0], [3, 4]))
    pool.cache_full_blocks(ids[:2], h, None, [1, 2, 3, 4], 2)
    assert pool.take_events() == [BlockStored((h[0], h[1]), None, (1, 2, 3, 4), 2)]
    assert pool.get_cached_block(h[1]).block_id == 1
    assert counts(pool) == (1, 0, 3)
    pool.free(reversed(ids))                               # tail first: 2, 1, 0
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert counts(pool) == (2, 2, 0)                       # blocks 0 and 1 keep their KV
    # a hit takes an evictable block off the free list
    pool.touch([0])
    assert pool.free_block_ids() == [3, 2, 1] and counts(pool) == (2, 1, 1)
    # allocation evicts in LRU order: 3 and 2 are plain, then 1 is evicted
    assert pool.allocate(3) == [3, 2, 1]
    assert pool.get_cached_block(h[1]) is None and pool.get_cached_block(h[0]).block_id == 0
    assert pool.take_events() == [BlockRemoved((h[1],))]
    assert pool.num_evictions == 1
    assert counts(pool) == (0, 0, 4)


def test_duplicate_hash_is_not_cached_twice_and_reset():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_full_blocks([a], [42], None, [1], 1)
    pool.cache_full_blocks([b], [42], None, [1], 1)        # same content computed twice
    assert pool.blocks[b].block_hash is None and pool.get_cached_block(42).block_id == a
    pool.free([a, b])
    assert counts(pool) == (2, 1, 0)
    assert pool.reset_prefix_cache() is True
    assert counts(pool) == (3, 0, 0) and pool.cached_block_hash_to_block == {}
    [c] = pool.allocate(1)
    pool.cache_full_blocks([c], [7], None, [1], 1)
    assert pool.reset_prefix_cache() is False              # block 7 is in use


def test_kv_cache_manager_grows_and_frees_last_block_first():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("a", 8) == []
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.allocate_slots("b", 4) == [3]
    assert kv.allocate_slots("c", 100) is None  # 25 blocks: nothing allocated
    assert "c" not in kv.req_to_blocks
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.check_integrity()
    kv.free("a")
    assert kv.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.allocate_slots("c", 12) == [4, 5, 6]
    assert kv.num_new_blocks("c", 13) == 1
    kv.free("b")
    kv.free("c")
    kv.free("unknown")  # no-op
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks == 10
    assert kv.get_computed_blocks(make_request("x", 9)) == ([], 0)  # caching off


def test_kv_cache_manager_prefix_hits_share_blocks_and_cap_at_num_tokens_minus_one():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, fingerprint=FP)
    a = make_request("a", 10)                              # tokens 0..9: blocks [0-3] [4-7] [8 9]
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots("a", 10) == [0, 1, 2]
    kv.cache_blocks(a, 10)                                 # two full blocks registered
    assert kv.block_hashes(a) == hash_full_blocks(a.all_token_ids, 4, FP.root_hash)
    assert [kv.block_pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]

    b = make_request("b", 9)                               # shares tokens 0..7
    blocks, n = kv.get_computed_blocks(b)
    assert (blocks, n) == ([0, 1], 8)
    assert kv.allocate_slots("b", 9, blocks) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]
    kv.check_integrity()

    c = make_request("c", 8)                               # a full hit is capped: last token recomputed
    assert kv.get_computed_blocks(c) == ([0], 4)

    kv.free("a")
    kv.free("b")
    assert counts(kv.block_pool) == (6, 2, 0)
    # evictable hits count against free space: 8 free blocks, two of them are the hits
    d = make_request("d", 30)
    blocks, n = kv.get_computed_blocks(d)
    assert (blocks, n) == ([0, 1], 8)
    assert kv.allocate_slots("d", 40, blocks) is None      # needs 10 blocks
    assert kv.allocate_slots("d", 32, blocks) == [4, 5, 6, 7, 2, 3]  # a freed 2 before b freed 3
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [1] * 8
    kv.free("d")
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_different_model_fingerprints_never_share_blocks():
    """Case C06 at the block level: model id, revision and adapter change the chain (its root);
    dtype, KV layout and tensor-parallel rank change the kvstore namespace, where the
    bytes of different executors meet (one engine's own prefix cache has one dtype)."""
    tokens = list(range(32))
    fingerprints = (FP, ModelFingerprint("m2", "r1"), ModelFingerprint("m", "r2"),
                    ModelFingerprint("m", "r1", adapter="lora-a"))
    roots = {fp.root_hash for fp in fingerprints}
    assert len(roots) == 4
    chains = {tuple(hash_full_blocks(tokens, 16, r)) for r in roots}
    assert len(chains) == 4
    layouts = [KVLayout(16, 2, 2, 64, dtype) for dtype in ("float32", "bfloat16", "float16")]
    layouts += [KVLayout(8, 2, 2, 64, "float32"), KVLayout(16, 2, 1, 64, "float32", tp_rank=1, tp_size=2)]
    namespaces = {KVStoreFingerprint(fp, layout).namespace for fp in fingerprints for layout in layouts}
    assert len(namespaces) == len(fingerprints) * len(layouts)
    assert hash_full_blocks(tokens, 16, FP.root_hash)[1] == hash_block_tokens(
        hash_block_tokens(FP.root_hash, tokens[:16]), tokens[16:])
    assert hash_full_blocks(tokens[:31], 16, FP.root_hash, 0) == hash_full_blocks(tokens, 16, FP.root_hash)[:1]
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(16, 2, 2, 64, "fp8")


def test_utilization_counts_shared_blocks_once():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, fingerprint=FP)
    assert kv.utilization({}) == 1.0
    a = make_request("a", 10)
    kv.allocate_slots("a", 10)
    kv.cache_blocks(a, 10)
    b = make_request("b", 9)
    blocks, n = kv.get_computed_blocks(b)
    kv.allocate_slots("b", 9, blocks)
    # blocks 0, 1 shared (8 tokens), a's block 2 holds 2, b's block 3 holds 1: 11 of 16 slots
    assert kv.utilization({"a": 10, "b": 9}) == 11 / 16
