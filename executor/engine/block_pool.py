"""BlockPool: the physical KV blocks, their reference counts, the prefix cache and
the free list that doubles as its LRU eviction order.

Every block is in exactly one of three states::

    free         ref_cnt 0, no cached content        on the free list
    evictable    ref_cnt 0, holds a cached full block on the free list, in the hash map
    referenced   ref_cnt >= 1 (held by one request, or shared by several)

Invariant (``check_integrity``): free + evictable + referenced == num_blocks.

Prefix caching (vLLM v1's design, Kwon et al. SOSP '23): a *full* block, once
its K/V are computed, is registered under its chain hash
(``meshserve.block_hash``). A later request whose prefix has the same hashes
takes the cached blocks (``touch``: one more reference each; an evictable block
leaves the free list) instead of computing them. A freed cached block keeps its
content and its hash: it is *evictable*, reusable until ``allocate`` hands it out
for new content, which evicts it. Allocation takes the head of the free list and
freeing appends to the tail, so the least recently freed block is evicted first
(LRU); callers free a request's blocks last block first, so a sequence's shared
beginning outlives its unique end.

Events: when ``enable_events`` is set, caching a block records a
``BlockStored`` and evicting one a ``BlockRemoved``; ``take_events`` drains
them (the executor forwards them to the scheduler's prefix-aware router).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from meshserve.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: index into the cache tensors' first dimension.
        ref_cnt: requests holding the block.
        block_hash: chain hash of its tokens while it is a cached full block, else None.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache.

    Attributes:
        block_hashes: their chain hashes, in sequence order.
        parent_block_hash: hash of the block before the first one (None: sequence start).
        token_ids: their tokens, ``len(block_hashes) * block_size`` ids.
        block_size: tokens per block.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (their KV is gone from this executor)."""

    block_hashes: tuple[BlockHash, ...]


KVCacheEvent = BlockStored | BlockRemoved


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free (a caller bug: check first)."""


class BlockPool:
    """Reference counts, prefix-cache map and LRU free list of ``num_blocks`` blocks.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
        enable_events: record ``BlockStored``/``BlockRemoved`` events.
    """

    def __init__(self, num_blocks: int, enable_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next evicted
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        self.enable_events = enable_events
        self._events: list[KVCacheEvent] = []
        self.num_evictions = 0
        self._num_evictable = 0  # free blocks with a hash, kept as a count: stats read it every step

    # -- counts ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (free or evictable): what ``allocate`` can take."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold cached content."""
        return self._num_evictable

    @property
    def num_referenced_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    # -- allocation -----------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` blocks from the head of the free list (least recently freed
        first), evicting their cached content; each gets reference count 1.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        evicted = []
        for block_id in ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_evictable -= 1
                evicted.append(block.block_hash)
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if evicted:
            self.num_evictions += len(evicted)
            if self.enable_events:
                self._events.append(BlockRemoved(tuple(evicted)))
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (a prefix-cache hit); an evictable block
        leaves the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                self._num_evictable -= block.block_hash is not None
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference of each block, in the given order; a block whose count
        reaches 0 goes to the tail of the free list (keeping its cached content).

        Raises:
            RuntimeError: a block is already free (double free: a caller bug).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                self._num_evictable += block.block_hash is not None

    # -- prefix cache ---------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block caching ``block_hash``, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                          parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                          block_size: int) -> list[tuple[int, BlockHash]]:
        """Registers computed full blocks under their chain hashes.

        A block whose hash is already cached by another block (two requests computed
        the same prefix at once) is left uncached; it is freed as a plain block.

        Args:
            block_ids: referenced blocks, in sequence order.
            block_hashes: their hashes (same length).
            parent_block_hash: hash of the block before ``block_ids[0]`` (None at the start).
            token_ids: their tokens (``len(block_ids) * block_size``), for the event.
            block_size: tokens per block.

        Returns:
            ``(block_id, block_hash)`` of the blocks newly registered, in order.
        """
        stored = []
        newly = []
        for block_id, block_hash in zip(block_ids, block_hashes):
            block = self.blocks[block_id]
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            stored.append(block_hash)
            newly.append((block_id, block_hash))
        if stored and self.enable_events:
            self._events.append(BlockStored(tuple(block_hashes), parent_block_hash, tuple(token_ids), block_size))
        return newly

    def reset_prefix_cache(self) -> bool:
        """Forgets every evictable block's content (e.g. after loading new weights).

        Returns:
            False (and nothing changes) while any cached block is referenced.
        """
        if any(block.ref_cnt for block in self.cached_block_hash_to_block.values()):
            return False
        removed = tuple(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self._num_evictable = 0
        if removed and self.enable_events:
            self._events.append(BlockRemoved(removed))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # -- checks ---------------------------------------------------------------

    def free_block_ids(self) -> list[int]:
        """The free list, head (next allocated) first."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Asserts free + evictable + referenced == num_blocks, free list ⇔ reference
        count 0, and that the hash map and the blocks' hashes agree.

        Raises:
            AssertionError: the pool's state is inconsistent.
        """
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block.block_id in self._free), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}"
            assert block.ref_cnt >= 0
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"block {block.block_id} has a hash the map does not point back from"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        evictable = sum(1 for block in self.cached_block_hash_to_block.values() if block.ref_cnt == 0)
        assert evictable == self._num_evictable, f"evictable count {self._num_evictable}, actual {evictable}"
        free = len(self._free) - evictable
        assert free + evictable + self.num_referenced_blocks == self.num_blocks
