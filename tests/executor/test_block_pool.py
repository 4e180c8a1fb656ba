"""BlockPool and KVCacheManager without a model: exact block ids and the invariant."""

from __future__ import annotations

import pytest

from executor.engine.block_pool import BlockPool, NoFreeBlocksError
from executor.engine.kv_cache_manager import KVCacheManager


def test_block_pool_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 3 and pool.num_referenced_blocks == 3
    pool.free([2, 0])
    assert pool.free_block_ids() == [3, 4, 5, 2, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]
    pool.check_integrity()
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 1, 1, 1, 1]


def test_block_pool_refcounts_and_errors():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.incref([a])
    pool.free([a])
    assert pool.num_free_blocks == 1  # still held once
    pool.free([a])
    assert pool.free_block_ids() == [1, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    with pytest.raises(RuntimeError, match="incref of free block"):
        pool.incref([0])
    pool.check_integrity()
    assert pool.cached_block_hash_to_block == {}  # prefix caching is not on yet


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
    assert kv.get_computed_blocks("x", [1, 2, 3, 4]) == ([], 0)
