"""KVCacheManager: each request's list of KV blocks and its prefix-cache hits, on
top of the BlockPool.

The manager owns the request → blocks map and the request → block hashes map; it
never writes a request's counters (the batch scheduler passes token counts in
and advances ``num_computed_tokens`` itself), so preemption and prefix hits cannot
desynchronise them.

Block ``i`` of a request holds its tokens ``[i * block_size, (i + 1) * block_size)``,
so a request with ``n`` tokens in the cache needs ``ceil(n / block_size)`` blocks.

Prefix caching, per request:

1. ``get_computed_blocks`` (when it is scheduled from waiting): the longest run of
   its full-block chain hashes found in the pool, capped at ``num_tokens - 1``
   tokens, so the last token is always recomputed and there is a position to
   sample from (a full-prompt hit still runs one token).
2. ``allocate_slots(..., new_computed_blocks)`` takes those blocks (one more
   reference each) and allocates the rest.
3. ``cache_blocks`` (after a step computed its tokens) registers the request's
   newly *computed* full blocks. Caching only computed blocks means a block's
   content is always valid when another request finds it, even if its owner is
   preempted or aborted right after.
"""

from __future__ import annotations

from executor.engine.block_pool import BlockPool
from executor.engine.request import Request
from meshserve.block_hash import BlockHash, ModelFingerprint, hash_full_blocks, salted_root


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` (all layers, K and V) that fit ``budget_bytes``.

    Raises:
        ValueError: not even one block fits.
    """
    n = budget_bytes // block_bytes
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes {budget_bytes} is less than one block ({block_bytes} bytes)")
    return n


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_caching: prefix caching on.
        fingerprint: the model identity, root of every chain hash (``meshserve.block_hash``:
            the one chain, also the KV events' and the kvstore's).
        enable_events: record the pool's stored/removed events.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 fingerprint: ModelFingerprint | None = None, enable_events: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.fingerprint = fingerprint or ModelFingerprint("unknown", "")
        self.root_hash = self.fingerprint.root_hash
        self.block_pool = BlockPool(num_blocks, enable_events)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}   # leading blocks already registered in the cache

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (free or evictable)."""
        return self.block_pool.num_free_blocks

    # -- prefix cache ---------------------------------------------------------

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chain hashes of the request's full blocks (computed incrementally, kept
        while the request lives), rooted at the model's root salted by the request's
        ``cache_salt``."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else salted_root(self.root_hash, request.cache_salt)
            hashes.extend(hash_full_blocks(request.all_token_ids, self.block_size, parent, len(hashes)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's tokens.

        Returns:
            Its block ids (not yet referenced: pass them to ``allocate_slots``) and
            its length in tokens, a multiple of ``block_size`` and at most
            ``num_tokens - 1``. ``([], 0)`` when caching is off or the request asks
            for prompt logprobs (those need every prompt position computed).
        """
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block.block_id)
        return blocks, len(blocks) * self.block_size

    def num_cached_tokens(self, request: Request) -> int:
        """The token count of ``get_computed_blocks``'s prefix, without its block ids."""
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return 0
        cached = self.block_pool.cached_block_hash_to_block
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_blocks = 0
        for block_hash in self.block_hashes(request):
            if num_blocks == max_blocks or block_hash not in cached:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def next_cacheable_hash(self, request: Request, num_hit: int) -> BlockHash | None:
        """The hash of the full block right after a ``num_hit``-token cached prefix,
        if the prefix cache could serve that block to this request; else None
        (caching off, prompt logprobs asked, or no full block there below
        ``num_tokens - 1``)."""
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return None
        index = num_hit // self.block_size
        if index >= (request.num_tokens - 1) // self.block_size:
            return None
        return self.block_hashes(request)[index]

    def pending_block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full prompt blocks it has not registered in the
        cache yet (it is computing them); empty when caching is off."""
        if not self.enable_caching:
            return []
        start = self.req_num_cached_blocks.get(request.request_id, 0)
        return self.block_hashes(request)[start:request.num_prompt_tokens // self.block_size]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[tuple[int, BlockHash]]:
        """Registers the request's full blocks among its first ``num_computed_tokens``
        tokens (whose K/V are computed) that are not registered yet.

        Returns:
            ``(block_id, block_hash)`` of the blocks this call entered into the cache
            (a block another request cached first is not among them).
        """
        if not self.enable_caching:
            return []
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self.req_num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return []
        hashes = self.block_hashes(request)
        blocks = self.req_to_blocks[rid]
        bs = self.block_size
        newly = self.block_pool.cache_full_blocks(blocks[start:num_full], hashes[start:num_full],
                                                  hashes[start - 1] if start else None,
                                                  request.all_token_ids[start * bs:num_full * bs], bs)
        self.req_num_cached_blocks[rid] = num_full
        return newly

    # -- allocation -----------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in logical order (a copy; empty if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request_id, ())))

    def allocate_slots(self, request_id: str, num_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Grows the request's blocks to hold ``num_tokens`` tokens (computed + new).

        Args:
            request_id: the request.
            num_tokens: tokens its blocks must hold after this step.
            new_computed_blocks: prefix-cache hits from ``get_computed_blocks``
                (only when the request holds no block yet); they are referenced and
                come first.

        Returns:
            The newly allocated block ids (possibly empty), or None when the pool has
            too few free blocks; then nothing changed.
        """
        hits = new_computed_blocks or []
        held = len(self.req_to_blocks.get(request_id, ())) + len(hits)
        n = max(0, cdiv(num_tokens, self.block_size) - held)
        # hits that are evictable leave the free list when referenced
        evictable_hits = sum(1 for b in hits if self.block_pool.blocks[b].ref_cnt == 0)
        if n + evictable_hits > self.block_pool.num_free_blocks:
            return None
        if hits:
            self.block_pool.touch(hits)
            self.req_to_blocks.setdefault(request_id, []).extend(hits)
            self.req_num_cached_blocks[request_id] = len(hits)
        new = self.block_pool.allocate(n)
        self.req_to_blocks.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str, keep_hashes: bool = False) -> None:
        """Returns all the request's blocks to the pool, last block first (a no-op
        when it holds none). Cached blocks stay reusable until evicted.

        Args:
            keep_hashes: keep the request's block hashes (a preempted request will
                look its blocks up again).
        """
        blocks = self.req_to_blocks.pop(request_id, [])
        self.req_num_cached_blocks.pop(request_id, None)
        if not keep_hashes:
            self.req_to_block_hashes.pop(request_id, None)
        self.block_pool.free(reversed(blocks))

    # -- stats and checks -----------------------------------------------------

    def utilization(self, num_tokens_by_request: dict[str, int]) -> float:
        """Tokens stored / slots of the blocks held by requests, in [0, 1].

        A block shared by several requests counts once. 1.0 when no block is held.

        Args:
            num_tokens_by_request: tokens each holding request has in its blocks.
        """
        bs = self.block_size
        slots = self.block_pool.num_referenced_blocks * bs
        if slots == 0:
            return 1.0
        seen: set[int] = set()
        stored = 0
        for rid, blocks in self.req_to_blocks.items():
            n = num_tokens_by_request.get(rid, 0)
            for i, block_id in enumerate(blocks):
                if block_id not in seen:
                    seen.add(block_id)
                    stored += max(0, min(bs, n - i * bs))
        return stored / slots

    def check_integrity(self) -> None:
        """Asserts the pool's invariant and that each block's reference count equals
        the number of requests holding it (a request holds a block at most once).

        Raises:
            AssertionError: inconsistent state.
        """
        self.block_pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            assert len(blocks) == len(set(blocks)), "a request holds a block twice"
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} requests")
