"""BlockPool: the physical KV blocks, their free list and reference counts.

The pool is the only owner of block state. A block is *free* (reference count
0, on the free list) or *referenced* (held by one request, or by several once
prefix caching shares full blocks). Conservation invariant, checked by
``check_integrity``::

    num_free_blocks + num_referenced_blocks == num_blocks

Allocation takes blocks from the head of the free list; freed blocks go to the
tail. Callers free a request's blocks tail-first, so the blocks that held the
*end* of a sequence are reused first and its (more shareable) beginning stays
intact longest, which is what prefix caching will want.

Prefix caching (next): ``cached_block_hash_to_block`` will map the chain hash of
a *full* block (hash of its parent's hash and its own token ids, defined once
and shared with the kvstore) to the block holding it. A freed cached block then
stays in the map, *evictable*, until the free list hands it out again; the
invariant becomes free + referenced + evictable == num_blocks (evictable blocks
are a subset of the free list), and the pool publishes stored/removed events.
Nothing is cached yet: the map stays empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable


@dataclass(eq=False)
class KVBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: index into the cache tensors' first dimension.
        ref_cnt: requests holding the block.
        block_hash: chain hash of its tokens once full and cached (prefix caching); None now.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free (a caller bug: check first)."""


class BlockPool:
    """Free list and reference counts of ``num_blocks`` physical blocks.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # chain hash -> block of a full, cached block (prefix caching; empty for now).
        self.cached_block_hash_to_block: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_referenced_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` blocks from the head of the free list, each with reference count 1.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for block_id in ids:
            self.blocks[block_id].ref_cnt = 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more holder for each (already referenced) block; for sharing cached blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"incref of free block {block_id}")
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference of each block, in the given order; a block whose count
        reaches 0 goes to the tail of the free list.

        Raises:
            RuntimeError: a block is already free (double free: a caller bug).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block_id)

    def free_block_ids(self) -> list[int]:
        """The free list, head (next allocated) first."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Asserts the conservation invariant and that free ⇔ reference count 0.

        Raises:
            AssertionError: the pool's state is inconsistent.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id}: ref_cnt {block.ref_cnt}"
        assert self.num_free_blocks + self.num_referenced_blocks == self.num_blocks
