"""The executor's prefix-cache events, as the scheduler's router wants them.

The engine's block pool records ``BlockStored`` / ``BlockRemoved`` events keyed
by the blocks' chain hashes (``meshserve.block_hash``: the one chain, which the
gateway computes for a prompt too, so the scheduler matches the two directly).
``KvEventBatcher`` (pure, no gRPC) keeps them in their 16-byte wire form as one
net batch until the scheduler link takes it, and can give a full snapshot for a
new Connect stream:

* batching: ``stored`` and ``removed`` of one batch are disjoint, the net
  effect of the events since the last ``take`` (a block stored then removed
  is only ``removed``, removed then stored only ``stored``);
* snapshot: ``snapshot`` clears the batch and returns every hash it believes
  cached (sent with ``reset`` on each new stream).

Memory: one entry per cached block.
"""

from __future__ import annotations

from typing import Iterable

from executor.engine.block_pool import BlockRemoved, BlockStored, KVCacheEvent
from meshserve.block_hash import hash_to_bytes


class KvEventBatcher:
    """Engine KV events → net batches of chain hashes (16-byte wire form)."""

    def __init__(self) -> None:
        self._cached: dict[bytes, None] = {}  # insertion-ordered set of what the engine caches
        self._stored: dict[bytes, None] = {}
        self._removed: dict[bytes, None] = {}

    def add(self, events: Iterable[KVCacheEvent]) -> None:
        """Applies engine events, oldest first."""
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    h = hash_to_bytes(block_hash)
                    self._cached[h] = None
                    self._removed.pop(h, None)
                    self._stored[h] = None
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    h = hash_to_bytes(block_hash)
                    if h in self._cached:
                        del self._cached[h]
                        self._stored.pop(h, None)
                        self._removed[h] = None

    def pending(self) -> bool:
        """Whether a batch is waiting."""
        return bool(self._stored or self._removed)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """The net ``(stored, removed)`` since the last take (both may be empty)."""
        batch = (list(self._stored), list(self._removed))
        self._stored, self._removed = {}, {}
        return batch

    def snapshot(self) -> list[bytes]:
        """Every hash believed cached now; clears the pending batch."""
        self._stored, self._removed = {}, {}
        return list(self._cached)

    def __len__(self) -> int:
        return len(self._cached)
