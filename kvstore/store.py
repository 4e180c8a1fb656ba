"""KVStore: the pure core of the kvstore service (no gRPC).

Content-addressed KV blocks keyed by ``(namespace, chain hash)``
(``meshserve.block_hash``), each with its CRC-32 (``meshserve.kvstore_payload``), held in
byte-bounded tiers::

    put ──▶ memory tier (LRU, memory_bytes) ──evict──▶ disk tier (LRU, disk_bytes) ──evict──▶ gone
              ▲                                              │
              └────────────── a read promotes ───────────────┘

* **Budgets**: each tier's stored payload bytes never exceed its budget; a put
  that cannot make room (the block is bigger than the tier, or every block that
  could go is leased) is refused (``PutStatus.NO_SPACE``), never over budget.
* **LRU**: a tier evicts its least recently *used* block first (a put or a read
  makes a block the most recent). Without a disk tier, memory evictions drop
  the block (LMCache's local CPU backend and Dynamo KVBM's G2/G3 tiers work the
  same way).
* **Leases**: ``acquire(owner, ...)`` pins blocks for a reader (a Get stream);
  a pinned block is never evicted (nor promoted away mid-read) until every
  owner holding it calls ``release(owner)``.
* **Checksums**: verified on put (a mismatch is refused with
  ``InvalidArgument``) and on every read from disk (a torn file is dropped and
  counted as corrupt, then read as a miss).
* **Placement events**: every change is appended to ``events``
  (``kvstore.events.PlacementLog``); ``snapshot()`` lists every stored block
  with the cursor it is valid at.

Single-threaded: the service calls it from its event loop only.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvstore.events import PlacementKind, PlacementLog
from kvstore.tiers import DiskTier, MemoryTier, Tier
from meshserve.errors import InvalidArgument, NotFound
from meshserve.kvstore_payload import checksum as crc32

logger = logging.getLogger(__name__)

NAMESPACE_BYTES = 16


class PutStatus:
    """Outcome of one ``put`` (values match the proto's ``PUT_STATUS_*``)."""

    STORED = 1      # now in the memory tier
    EXISTS = 2      # already stored (made most recent); the new copy is dropped
    NO_SPACE = 3    # refused: no room without evicting a leased block, or bigger than the tier


@dataclass
class _Entry:
    size: int       # payload bytes
    checksum: int   # CRC-32 of the payload


@dataclass
class _TierState:
    tier: Tier
    capacity: int                                   # bytes
    used: int = 0                                   # bytes of stored payloads
    lru: OrderedDict = field(default_factory=OrderedDict)  # key -> _Entry, head = least recently used


@dataclass(frozen=True)
class StoreStats:
    """Counters of the store (bytes are payload bytes; blocks are block payloads).

    Attributes:
        memory_capacity_bytes, memory_used_bytes, memory_blocks: the memory tier.
        disk_capacity_bytes, disk_used_bytes, disk_blocks: the disk tier (0 without one).
        hit_blocks: blocks found by lookups and reads.
        miss_blocks: lookups and reads that stopped at a missing block (one per call).
        bytes_in: payload bytes accepted by put.
        bytes_out: payload bytes returned by read.
        blocks_stored: puts that stored a new block.
        memory_evictions: blocks that left the memory tier to make room (demoted or dropped).
        disk_evictions: blocks that left the disk tier to make room.
        blocks_removed: blocks that left the store entirely.
        rejected_no_space: puts refused for lack of room.
        corrupt_blocks: blocks dropped because their bytes failed the checksum.
        num_leases: (owner, block) leases held now.
        num_lease_owners: owners holding at least one lease.
    """

    memory_capacity_bytes: int
    memory_used_bytes: int
    memory_blocks: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_blocks: int
    hit_blocks: int
    miss_blocks: int
    bytes_in: int
    bytes_out: int
    blocks_stored: int
    memory_evictions: int
    disk_evictions: int
    blocks_removed: int
    rejected_no_space: int
    corrupt_blocks: int
    num_leases: int
    num_lease_owners: int


def make_key(namespace: bytes, block_hash: int) -> bytes:
    """The 32-byte store key of a block.

    Raises:
        InvalidArgument: the namespace is not 16 bytes or the hash not a 128-bit int.
    """
    if len(namespace) != NAMESPACE_BYTES:
        raise InvalidArgument(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    if not 0 <= block_hash < 1 << 128:
        raise InvalidArgument("block_hash must be a 128-bit unsigned int")
    return namespace + block_hash.to_bytes(16, "little")


class KVStore:
    """Tiers, LRU, leases, checksums and placement events.

    Args:
        memory_bytes: budget of the memory tier (bytes, >= 1).
        disk_dir: directory of the disk tier (None: no disk tier); emptied at start.
        disk_bytes: budget of the disk tier (bytes, >= 1 when ``disk_dir`` is set).
        max_events: placement events retained for followers.

    Raises:
        ValueError: a budget < 1.
    """

    def __init__(self, memory_bytes: int, disk_dir: str | Path | None = None, disk_bytes: int = 0,
                 max_events: int = 65536):
        if memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {memory_bytes}")
        if disk_dir is not None and disk_bytes < 1:
            raise ValueError(f"disk_bytes must be >= 1 with a disk tier, got {disk_bytes}")
        self.memory = _TierState(MemoryTier(), memory_bytes)
        self.disk = _TierState(DiskTier(disk_dir), disk_bytes) if disk_dir is not None else None
        self.events = PlacementLog(max_events)
        self._pins: Counter[bytes] = Counter()            # key -> leases on it
        self._leases: dict[str, Counter[bytes]] = {}      # owner -> key -> count
        self._counters = Counter()

    # -- queries --------------------------------------------------------------

    def _tier_of(self, key: bytes) -> _TierState | None:
        if key in self.memory.lru:
            return self.memory
        if self.disk is not None and key in self.disk.lru:
            return self.disk
        return None

    def lookup(self, namespace: bytes, block_hashes: Sequence[int]) -> int:
        """Length (in blocks) of the longest stored prefix of a hash chain."""
        n = 0
        for block_hash in block_hashes:
            if self._tier_of(make_key(namespace, block_hash)) is None:
                break
            n += 1
        self._counters["hit_blocks"] += n
        self._counters["miss_blocks"] += n < len(block_hashes)
        return n

    def snapshot(self) -> tuple[int, list[tuple[bytes, int, str]]]:
        """``(cursor, [(namespace, block_hash, tier), ...])``: every stored block, as
        of the placement log's cursor (memory blocks first, each tier LRU first)."""
        tiers = [self.memory] + ([self.disk] if self.disk else [])
        blocks = [(k[:16], int.from_bytes(k[16:], "little"), t.tier.name) for t in tiers for k in t.lru]
        return self.events.cursor, blocks

    def lru_order(self, tier: str = "memory") -> list[tuple[bytes, int]]:
        """``(namespace, block_hash)`` of a tier's blocks, next evicted first."""
        state = self.memory if tier == "memory" else self.disk
        return [] if state is None else [(k[:16], int.from_bytes(k[16:], "little")) for k in state.lru]

    # -- put ------------------------------------------------------------------

    def put(self, namespace: bytes, block_hash: int, data: bytes, data_checksum: int) -> int:
        """Stores one block's payload in the memory tier (evicting LRU blocks).

        Returns:
            A ``PutStatus`` value.

        Raises:
            InvalidArgument: bad key, or ``data_checksum`` is not the CRC-32 of ``data``
                (nothing is stored).
        """
        key = make_key(namespace, block_hash)
        if crc32(data) != data_checksum:
            raise InvalidArgument(f"checksum mismatch for block {block_hash:032x}: payload is corrupt")
        tier = self._tier_of(key)
        if tier is not None:
            tier.lru.move_to_end(key)
            return PutStatus.EXISTS
        if not self._make_room(self.memory, len(data)):
            self._counters["rejected_no_space"] += 1
            return PutStatus.NO_SPACE
        self._insert(self.memory, key, data, _Entry(len(data), data_checksum))
        self._counters["bytes_in"] += len(data)
        self._counters["blocks_stored"] += 1
        self.events.append(PlacementKind.STORED, namespace, block_hash, "memory")
        return PutStatus.STORED

    def _insert(self, state: _TierState, key: bytes, data: bytes, entry: _Entry) -> None:
        state.tier.write(key, data)
        state.lru[key] = entry
        state.used += entry.size

    def _insert_on_disk(self, key: bytes, data: bytes, entry: _Entry) -> bool:
        """Writes a block to the disk tier; False (logged, nothing kept) when the
        medium fails (disk full…): the caller counts the block as removed."""
        try:
            self._insert(self.disk, key, data, entry)
        except OSError as exc:
            logger.warning("kvstore: block %s not written to the disk tier, dropped: %s", key[16:].hex(), exc)
            return False
        return True

    def _drop(self, state: _TierState, key: bytes) -> _Entry:
        entry = state.lru.pop(key)
        state.used -= entry.size
        state.tier.delete(key)
        return entry

    def _make_room(self, state: _TierState, size: int) -> bool:
        """Evicts unleased LRU blocks of ``state`` until ``size`` more bytes fit.
        Evicts nothing when it cannot succeed."""
        if size > state.capacity:
            return False
        need = state.used + size - state.capacity
        victims = []
        for key, entry in state.lru.items():
            if need <= 0:
                break
            if self._pins[key]:
                continue
            victims.append(key)
            need -= entry.size
        if need > 0:
            return False
        for key in victims:
            self._evict(state, key)
        return True

    def _evict(self, state: _TierState, key: bytes) -> None:
        data = state.tier.read(key)
        entry = self._drop(state, key)
        ns, block_hash = key[:16], int.from_bytes(key[16:], "little")
        if state is self.memory:
            self._counters["memory_evictions"] += 1
            disk = self.disk
            if disk is not None and data is not None and self._make_room(disk, entry.size) \
                    and self._insert_on_disk(key, data, entry):
                self.events.append(PlacementKind.MOVED, ns, block_hash, "disk")
                return
        else:
            self._counters["disk_evictions"] += 1
        self._counters["blocks_removed"] += 1
        self.events.append(PlacementKind.REMOVED, ns, block_hash, state.tier.name)

    # -- read -----------------------------------------------------------------

    def read(self, namespace: bytes, block_hash: int) -> tuple[bytes, int]:
        """One block's payload and checksum; the block becomes most recent, and a
        block read from disk moves to memory when memory has room for it.

        Raises:
            NotFound: the block is not stored (or its disk copy failed its checksum
                and was dropped).
        """
        key = make_key(namespace, block_hash)
        state = self._tier_of(key)
        data = None if state is None else state.tier.read(key)
        if state is not None and (data is None or crc32(data) != state.lru[key].checksum):
            self._drop(state, key)
            self._counters["corrupt_blocks"] += 1
            self._counters["blocks_removed"] += 1
            self.events.append(PlacementKind.REMOVED, namespace, block_hash, state.tier.name)
            data = state = None
        if state is None:
            raise NotFound(f"block {block_hash:032x} is not in the kvstore")
        entry = state.lru[key]
        state.lru.move_to_end(key)
        if state is self.disk:
            # leave disk first so the demotions making room in memory can use its space;
            # when memory has no room nothing was evicted, so it fits back on disk
            self._drop(self.disk, key)
            if self._make_room(self.memory, entry.size):
                self._insert(self.memory, key, data, entry)
                self.events.append(PlacementKind.MOVED, namespace, block_hash, "memory")
            elif not self._insert_on_disk(key, data, entry):  # its bytes are read: this Get still gets them
                self._counters["blocks_removed"] += 1
                self.events.append(PlacementKind.REMOVED, namespace, block_hash, "disk")
        self._counters["bytes_out"] += len(data)
        return data, entry.checksum

    # -- leases ---------------------------------------------------------------

    def acquire(self, owner: str, namespace: bytes, block_hashes: Sequence[int]) -> int:
        """Leases the longest stored prefix of ``block_hashes`` to ``owner``: those
        blocks cannot be evicted until ``release(owner)``. Counts hits and misses
        like ``lookup``.

        Returns:
            The number of blocks leased (the prefix length).

        Raises:
            InvalidArgument: empty owner or a bad key.
        """
        if not owner:
            raise InvalidArgument("lease owner must not be empty")
        n = self.lookup(namespace, block_hashes)
        held = self._leases.setdefault(owner, Counter())
        for block_hash in block_hashes[:n]:
            key = make_key(namespace, block_hash)
            held[key] += 1
            self._pins[key] += 1
        if not held:
            del self._leases[owner]
        return n

    def release(self, owner: str) -> int:
        """Drops every lease ``owner`` holds (no-op for an unknown owner).

        Returns:
            Leases released.
        """
        held = self._leases.pop(owner, Counter())
        for key, count in held.items():
            self._pins[key] -= count
            if self._pins[key] <= 0:
                del self._pins[key]
        return sum(held.values())

    # -- stats ----------------------------------------------------------------

    def stats(self) -> StoreStats:
        c, disk = self._counters, self.disk
        return StoreStats(
            memory_capacity_bytes=self.memory.capacity, memory_used_bytes=self.memory.used,
            memory_blocks=len(self.memory.lru),
            disk_capacity_bytes=disk.capacity if disk else 0, disk_used_bytes=disk.used if disk else 0,
            disk_blocks=len(disk.lru) if disk else 0,
            hit_blocks=c["hit_blocks"], miss_blocks=c["miss_blocks"], bytes_in=c["bytes_in"],
            bytes_out=c["bytes_out"], blocks_stored=c["blocks_stored"], memory_evictions=c["memory_evictions"],
            disk_evictions=c["disk_evictions"], blocks_removed=c["blocks_removed"],
            rejected_no_space=c["rejected_no_space"], corrupt_blocks=c["corrupt_blocks"],
            num_leases=sum(self._pins.values()), num_lease_owners=len(self._leases),
        )

    def check_integrity(self) -> None:
        """Asserts each tier's used bytes == the sum of its entries and <= its budget,
        and no key is in two tiers.

        Raises:
            AssertionError: inconsistent state (a bug).
        """
        for state in [self.memory] + ([self.disk] if self.disk else []):
            assert state.used == sum(e.size for e in state.lru.values())
            assert state.used <= state.capacity, f"{state.tier.name}: {state.used} > {state.capacity}"
        if self.disk:
            assert not set(self.memory.lru) & set(self.disk.lru)
        assert sum(self._pins.values()) == sum(sum(h.values()) for h in self._leases.values())
