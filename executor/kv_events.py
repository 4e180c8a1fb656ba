"""The executor's prefix-cache events, as the scheduler's router wants them.

The engine's block pool records ``BlockStored`` / ``BlockRemoved`` events keyed
by the engine's chain hashes, whose root includes the dtype
(``meshserve.block_hash``). ``KvEventBatcher`` (pure, no gRPC) turns them into
hashes of the *routing chain* (root: ``routing_fingerprint``, which the gateway
can compute too), keeps them as one net batch until the scheduler link takes
it, and can give a full snapshot for a new Connect stream:

* translation: it keeps ``engine hash → routing hash`` for every block it
  believes cached; a stored block's routing hash is
  ``hash_block_tokens(routing hash of its parent, its tokens)`` (the root for a
  sequence's first block). A stored block whose parent it does not know (the
  parent was evicted under a duplicate, a rare race) is skipped: routing then
  under-estimates, never over-estimates, that executor's hits;
* batching: ``stored`` and ``removed`` of one batch are disjoint, the net
  effect of the events since the last ``take`` (a block stored then removed
  is only ``removed``, removed then stored only ``stored``);
* snapshot: ``snapshot`` clears the batch and returns every routing hash it
  believes cached (sent with ``reset`` on each new stream).

Memory: one entry per cached block.
"""

from __future__ import annotations

from typing import Iterable

from executor.engine.block_pool import BlockRemoved, BlockStored, KVCacheEvent
from meshserve.block_hash import BlockHash, ModelFingerprint, hash_block_tokens, hash_to_bytes, routing_fingerprint


class KvEventBatcher:
    """Engine KV events → net batches of routing-chain hashes (16-byte wire form).

    Args:
        fingerprint: the engine's model fingerprint (its dtype is dropped).
    """

    def __init__(self, fingerprint: ModelFingerprint):
        self.routing_root = routing_fingerprint(fingerprint).root_hash
        self._routing: dict[BlockHash, bytes] = {}
        self._stored: dict[bytes, None] = {}  # insertion-ordered set
        self._removed: dict[bytes, None] = {}

    def add(self, events: Iterable[KVCacheEvent]) -> None:
        """Applies engine events, oldest first."""
        for event in events:
            if isinstance(event, BlockStored):
                self._on_stored(event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    h = self._routing.pop(engine_hash, None)
                    if h is not None:
                        self._stored.pop(h, None)
                        self._removed[h] = None

    def _on_stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent = self.routing_root
        else:
            known = self._routing.get(event.parent_block_hash)
            if known is None:
                return
            parent = int.from_bytes(known, "little")
        bs = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            parent = hash_block_tokens(parent, event.token_ids[i * bs:(i + 1) * bs])
            h = hash_to_bytes(parent)
            self._routing[engine_hash] = h
            self._removed.pop(h, None)
            self._stored[h] = None

    def pending(self) -> bool:
        """Whether a batch is waiting."""
        return bool(self._stored or self._removed)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """The net ``(stored, removed)`` since the last take (both may be empty)."""
        batch = (list(self._stored), list(self._removed))
        self._stored, self._removed = {}, {}
        return batch

    def snapshot(self) -> list[bytes]:
        """Every routing hash believed cached now; clears the pending batch."""
        self._stored, self._removed = {}, {}
        return list(dict.fromkeys(self._routing.values()))

    def __len__(self) -> int:
        return len(self._routing)
