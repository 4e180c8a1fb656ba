"""Which executor holds which cached prefix block: chain hash → executor ids.

Executors forward their prefix cache's events on the Connect stream
(``KvEvents``: stored and removed chain hashes, ``meshserve.block_hash``); the
scheduler applies them here and asks, for a request's chain of block hashes,
how many *leading* blocks each executor holds. Only a leading run counts: an
executor's engine reuses cached blocks up to the first one it lacks.

The index holds 16-byte chain hashes as the wire carries them. An executor that
disconnects (or sends a ``reset`` snapshot) is dropped from it at once. Memory:
one entry per cached block per executor, bounded by the executors' caches.
Invariant (``check_integrity``): ``executor ∈ holders[h]`` ⟺ ``h ∈ blocks_of[executor]``.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class PrefixIndex:
    """chain hash (bytes) → ids of the executors whose prefix cache holds that block."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks_of: dict[str, set[bytes]] = {}

    def stored(self, executor_id: str, block_hashes: Iterable[bytes]) -> None:
        """Blocks entered ``executor_id``'s prefix cache."""
        mine = self._blocks_of.setdefault(executor_id, set())
        for h in block_hashes:
            self._holders.setdefault(h, set()).add(executor_id)
            mine.add(h)

    def removed(self, executor_id: str, block_hashes: Iterable[bytes]) -> None:
        """Blocks left ``executor_id``'s prefix cache (evicted); unknown hashes are ignored."""
        mine = self._blocks_of.get(executor_id, set())
        for h in block_hashes:
            mine.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(executor_id)
                if not holders:
                    del self._holders[h]

    def drop(self, executor_id: str) -> None:
        """Forgets everything ``executor_id`` held (it disconnected or resets its snapshot)."""
        self.removed(executor_id, list(self._blocks_of.pop(executor_id, ())))

    def num_blocks(self, executor_id: str) -> int:
        """Cached blocks indexed for ``executor_id``."""
        return len(self._blocks_of.get(executor_id, ()))

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of the chain ``block_hashes`` each executor holds.

        Returns:
            executor id → number of leading blocks (>= 1) it holds; executors
            holding not even the first block are absent. O(len(block_hashes)).
        """
        hits: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(block_hashes, start=1):
            holders = self._holders.get(h)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for executor_id in alive:
                hits[executor_id] = depth
        return hits

    def check_integrity(self) -> None:
        """Asserts the two maps agree (tests).

        Raises:
            AssertionError: they do not (a bug).
        """
        pairs = {(h, e) for h, es in self._holders.items() for e in es}
        assert all(es for es in self._holders.values()), "empty holder set"
        assert pairs == {(h, e) for e, hs in self._blocks_of.items() for h in hs}, "holders != blocks_of"
