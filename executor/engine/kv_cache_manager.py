"""KVCacheManager: each request's list of KV blocks, on top of the BlockPool.

The manager owns the request → blocks map and nothing else: it never reads or
writes a request's counters (the batch scheduler passes the token counts in), so
preemption and future prefix hits cannot desynchronise them.

Block ``i`` of a request holds its tokens ``[i * block_size, (i + 1) * block_size)``,
so a request with ``n`` tokens in the cache needs ``ceil(n / block_size)`` blocks.
"""

from __future__ import annotations

from executor.engine.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees the blocks of each request.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> tuple[list[int], int]:
        """The longest cached prefix of ``token_ids``: its blocks and its length (tokens).

        Prefix caching is the next step (chain hashes of full blocks looked up in
        ``BlockPool.cached_block_hash_to_block``; a full hit must still recompute the
        last token so there is a position to sample from). Until then: no hit.
        """
        return [], 0

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in logical order (a copy; empty if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request_id, ())))

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grows the request's blocks to hold ``num_tokens`` tokens (computed + new).

        Returns:
            The newly allocated block ids (possibly empty), or None when the pool has
            too few free blocks; then nothing changed.
        """
        n = self.num_new_blocks(request_id, num_tokens)
        if n > self.block_pool.num_free_blocks:
            return None
        new = self.block_pool.allocate(n)
        self.req_to_blocks.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Returns all the request's blocks to the pool, last block first (a no-op
        when it holds none)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free(reversed(blocks))

    def check_integrity(self) -> None:
        """Asserts the pool's invariant and that the blocks held by requests are exactly
        the referenced ones, each once.

        Raises:
            AssertionError: inconsistent state.
        """
        self.block_pool.check_integrity()
        held = [b for blocks in self.req_to_blocks.values() for b in blocks]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert len(held) == self.block_pool.num_referenced_blocks, (
            f"{len(held)} blocks held by requests, {self.block_pool.num_referenced_blocks} referenced")
