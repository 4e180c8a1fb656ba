"""Placement events: which blocks the kvstore holds, as a log with cursors.

A follower (the scheduler's prefix-aware router) calls ``WatchPlacements`` with
its last cursor: it gets a snapshot of every stored block and then the deltas
after it, or the deltas alone when its cursor is still in the retained log.
Cursors are sequence numbers: event ``n`` has ``seq == n`` (from 1); a cursor
means "I have applied every event up to it". The log keeps the last
``max_events`` events; a cursor older than that gets a new snapshot.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class PlacementKind(enum.IntEnum):
    """What happened to a block (values match the proto's ``PLACEMENT_KIND_*``)."""

    STORED = 1    # entered the store, in ``tier``
    MOVED = 2     # changed tier (memory -> disk on eviction, disk -> memory on a read)
    REMOVED = 3   # left the store


@dataclass(frozen=True)
class PlacementEvent:
    """One change of the store's contents.

    Attributes:
        seq: sequence number (cursor after applying it), from 1.
        kind: see ``PlacementKind``.
        namespace: 16-byte ``KVStoreFingerprint.namespace``.
        block_hash: the block's chain hash.
        tier: ``"memory"`` or ``"disk"`` (where it is now; where it was for REMOVED).
    """

    seq: int
    kind: PlacementKind
    namespace: bytes
    block_hash: int
    tier: str


class PlacementLog:
    """The retained tail of placement events.

    Args:
        max_events: events kept (>= 1).
    """

    def __init__(self, max_events: int = 65536):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: deque[PlacementEvent] = deque(maxlen=max_events)
        self.cursor = 0
        self.listeners: list = []  # callables(event), called after each append (the service wakes its watchers)

    def append(self, kind: PlacementKind, namespace: bytes, block_hash: int, tier: str) -> PlacementEvent:
        """Records an event and returns it (its ``seq`` is the new cursor)."""
        self.cursor += 1
        event = PlacementEvent(self.cursor, kind, namespace, block_hash, tier)
        self._events.append(event)
        for listener in self.listeners:
            listener(event)
        return event

    def since(self, cursor: int) -> list[PlacementEvent] | None:
        """Events with ``seq > cursor``, oldest first; None when some of them are no
        longer retained (or the cursor is from the future, e.g. a restarted store):
        the follower needs a snapshot."""
        if cursor == self.cursor:
            return []
        if cursor > self.cursor or not self._events or cursor < self._events[0].seq - 1:
            return None
        return [e for e in self._events if e.seq > cursor]
