"""Which prefix blocks the kvstore holds: namespace → chain hashes (pure, no gRPC).

The scheduler follows the kvstore's placement stream (``scheduler.kvstore_follower``)
into this index. The kvstore keys a block by its namespace
(``KVStoreFingerprint.namespace``: model identity, dtype, KV layout) and its chain
hash (``meshserve.block_hash``: the one chain, which the gateway also sends with a
request, ``AdmitRequest.block_hashes``). An executor that shares KV through the
kvstore registers its namespace, so for a request the scheduler knows how many
leading prompt blocks that executor could fetch instead of computing
(``scheduler.routing``: they are credited at ``kvstore_token_cost``).

Tiers do not matter here (memory or disk, a block can be fetched). A snapshot
(events with ``snapshot`` set, then ``SNAPSHOT_END``) replaces the whole view; a
delta applies to it. Memory: one entry per stored block.
"""

from __future__ import annotations

from typing import Sequence

STORED, MOVED, REMOVED, SNAPSHOT_END = 1, 2, 3, 4  # kvstore_pb2.PlacementKind values


class KVStoreIndex:
    """namespace (16 bytes) → set of chain hashes (16 bytes) stored in the kvstore.

    Attributes:
        cursor: the last placement event applied (0: none).
    """

    def __init__(self) -> None:
        self._blocks: dict[bytes, set[bytes]] = {}
        self._staging: dict[bytes, set[bytes]] | None = None
        self.cursor = 0

    def apply(self, seq: int, kind: int, namespace: bytes, block_hash: bytes, snapshot: bool) -> None:
        """Applies one placement event (``kvstore.v1.PlacementEvent`` fields).

        A snapshot entry goes to a staging view that replaces the index at its
        ``SNAPSHOT_END``; until then routing keeps using the previous view.
        """
        if snapshot:
            if self._staging is None:
                self._staging = {}
            if kind == SNAPSHOT_END:
                self._blocks, self._staging = self._staging, None
            elif kind in (STORED, MOVED):
                self._staging.setdefault(namespace, set()).add(block_hash)
        elif kind in (STORED, MOVED):
            self._blocks.setdefault(namespace, set()).add(block_hash)
        elif kind == REMOVED:
            held = self._blocks.get(namespace)
            if held is not None:
                held.discard(block_hash)
                if not held:
                    del self._blocks[namespace]
        self.cursor = max(self.cursor, seq)

    def clear(self) -> None:
        """Forgets everything (the kvstore is unreachable: nothing can be fetched)."""
        self._blocks, self._staging, self.cursor = {}, None, 0

    def num_blocks(self, namespace: bytes | None = None) -> int:
        """Blocks indexed (in one namespace, or in all)."""
        if namespace is not None:
            return len(self._blocks.get(namespace, ()))
        return sum(len(v) for v in self._blocks.values())

    def hit_blocks(self, namespace: bytes, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain ``block_hashes`` stored under ``namespace``."""
        held = self._blocks.get(namespace)
        if not held:
            return 0
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n
