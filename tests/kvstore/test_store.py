"""The kvstore's pure core: exact LRU eviction order over tiers, byte budgets that
are never exceeded, leases that pin blocks, checksums, placement events."""

from __future__ import annotations

import pytest

from kvstore.events import PlacementKind
from kvstore.store import KVStore, PutStatus
from meshserve.errors import InvalidArgument, NotFound
from meshserve.kvstore_payload import checksum, chunks

NS = bytes(range(16))
OTHER_NS = bytes(16)


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def put(store: KVStore, h: int, size: int = 100, ns: bytes = NS) -> int:
    data = block(h, size)
    return store.put(ns, h, data, checksum(data))


def test_eviction_order_is_exact_lru_without_disk():
    store = KVStore(memory_bytes=300)
    assert [put(store, h) for h in (1, 2, 3)] == [PutStatus.STORED] * 3
    store.read(NS, 1)                      # 1 becomes most recent: order 2, 3, 1
    assert put(store, 4) == PutStatus.STORED  # evicts 2
    assert store.lru_order() == [(NS, 3), (NS, 1), (NS, 4)]
    assert put(store, 3) == PutStatus.EXISTS  # a repeat put refreshes: 1, 4, 3
    assert put(store, 5) == PutStatus.STORED  # evicts 1
    assert store.lru_order() == [(NS, 4), (NS, 3), (NS, 5)]
    assert store.lookup(NS, [1, 2, 3]) == 0
    s = store.stats()
    assert (s.memory_used_bytes, s.memory_blocks, s.memory_evictions, s.blocks_removed) == (300, 3, 2, 2)
    store.check_integrity()


def test_budget_never_exceeded_with_mixed_sizes():
    store = KVStore(memory_bytes=1000)
    sizes = [300, 250, 400, 100, 999, 1000, 1, 500, 450, 60]
    for h, size in enumerate(sizes):
        put(store, h, size)
        store.check_integrity()
        assert store.stats().memory_used_bytes <= 1000
    assert put(store, 99, 1001) == PutStatus.NO_SPACE  # bigger than the tier
    assert store.stats().rejected_no_space == 1
    assert [h for _, h in store.lru_order()] == [8, 9]  # 7 (500) had to go for 9: 500 + 450 + 60 > 1000
    assert store.stats().memory_used_bytes == 510


def test_memory_evictions_demote_to_disk_then_disk_lru(tmp_path):
    store = KVStore(memory_bytes=200, disk_dir=tmp_path / "kv", disk_bytes=200)
    for h in (1, 2, 3, 4, 5):
        put(store, h)
    # memory holds 4, 5; disk held 1, 2 then 3 pushed 1 out of the store
    assert store.lru_order("memory") == [(NS, 4), (NS, 5)]
    assert store.lru_order("disk") == [(NS, 2), (NS, 3)]
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == sorted(
        (NS + h.to_bytes(16, "little")).hex() + ".kv" for h in (2, 3))
    data, crc = store.read(NS, 2)          # a disk hit is promoted, demoting 4
    assert data == block(2) and crc == checksum(block(2))
    assert store.lru_order("memory") == [(NS, 5), (NS, 2)]
    assert store.lru_order("disk") == [(NS, 3), (NS, 4)]  # 2 left disk first: 4 took its place
    s = store.stats()
    assert (s.memory_evictions, s.disk_evictions, s.blocks_removed) == (4, 1, 1)
    assert (s.memory_used_bytes, s.disk_used_bytes) == (200, 200)
    store.check_integrity()


def _unwritable_on_disk(directory, h: int) -> None:
    """The disk tier's next write of block ``h`` fails (IsADirectoryError: a folder
    holds its temporary file's name), as a full disk's would, while reads still work."""
    (directory / ((NS + h.to_bytes(16, "little")).hex() + ".tmp")).mkdir()


def test_a_demotion_the_disk_cannot_write_removes_the_block_and_the_put_succeeds(tmp_path):
    store = KVStore(memory_bytes=200, disk_dir=tmp_path / "kv", disk_bytes=200)
    put(store, 1), put(store, 2)
    _unwritable_on_disk(tmp_path / "kv", 1)
    assert put(store, 3) == PutStatus.STORED   # evicting 1 to disk failed: 1 is gone, logged as removed
    assert (store.lru_order("memory"), store.lru_order("disk")) == ([(NS, 2), (NS, 3)], [])
    assert store.lookup(NS, [1]) == 0
    assert [(e.kind, e.block_hash, e.tier) for e in store.events.since(2)] == [
        (PlacementKind.REMOVED, 1, "memory"), (PlacementKind.STORED, 3, "memory")]
    s = store.stats()
    assert (s.memory_evictions, s.blocks_removed, s.disk_used_bytes) == (1, 1, 0)
    assert put(store, 4) == PutStatus.STORED   # later puts still demote to disk
    assert store.lru_order("disk") == [(NS, 2)]
    store.check_integrity()


def test_a_disk_read_that_cannot_be_written_back_still_answers_and_removes_the_block(tmp_path):
    store = KVStore(memory_bytes=200, disk_dir=tmp_path / "kv", disk_bytes=200)
    for h in (1, 2, 3):
        put(store, h)                        # 1 demoted to disk
    assert (store.acquire("a", NS, [2]), store.acquire("b", NS, [3])) == (1, 1)  # memory cannot make room
    _unwritable_on_disk(tmp_path / "kv", 1)
    data, crc = store.read(NS, 1)            # left disk to be promoted; no room, and disk cannot take it back
    assert (data, crc) == (block(1), checksum(block(1)))
    assert (store.lookup(NS, [1]), store.lru_order("disk")) == (0, [])
    assert [(e.kind, e.block_hash, e.tier) for e in store.events.since(4)] == [(PlacementKind.REMOVED, 1, "disk")]
    assert (store.stats().blocks_removed, store.stats().disk_used_bytes) == (1, 0)
    store.release("a"), store.release("b")
    store.check_integrity()


def test_leased_blocks_are_never_evicted():
    store = KVStore(memory_bytes=300)
    for h in (1, 2, 3):
        put(store, h)
    assert store.acquire("req-a", NS, [1, 2, 9]) == 2
    assert store.stats().num_leases == 2
    assert put(store, 4) == PutStatus.STORED  # 1 and 2 are leased: 3 goes
    assert store.lru_order() == [(NS, 1), (NS, 2), (NS, 4)]
    assert store.acquire("req-b", NS, [4]) == 1
    assert put(store, 5) == PutStatus.NO_SPACE  # everything leased: refused, nothing evicted
    assert store.lru_order() == [(NS, 1), (NS, 2), (NS, 4)]
    assert store.release("req-a") == 2 and store.release("req-a") == 0
    assert put(store, 5) == PutStatus.STORED  # now 1 goes
    assert store.lru_order() == [(NS, 2), (NS, 4), (NS, 5)]
    store.release("req-b")
    s = store.stats()
    assert (s.num_leases, s.num_lease_owners) == (0, 0)
    store.check_integrity()


def test_lookup_is_the_longest_prefix_and_namespaces_never_mix():
    store = KVStore(memory_bytes=10_000)
    for h in (1, 2, 4):
        put(store, h)
    assert store.lookup(NS, [1, 2, 3, 4]) == 2
    assert store.lookup(NS, [4]) == 1
    assert store.lookup(OTHER_NS, [1, 2]) == 0
    with pytest.raises(NotFound):
        store.read(OTHER_NS, 1)
    s = store.stats()
    assert (s.hit_blocks, s.miss_blocks) == (3, 2)


def test_checksums_are_verified_on_put_and_on_disk_reads(tmp_path):
    store = KVStore(memory_bytes=100, disk_dir=tmp_path, disk_bytes=1000)
    with pytest.raises(InvalidArgument, match="checksum mismatch"):
        store.put(NS, 1, block(1), checksum(block(1)) ^ 1)
    assert store.lookup(NS, [1]) == 0
    put(store, 1)
    put(store, 2)                          # 1 goes to disk
    path = tmp_path / f"{(NS + (1).to_bytes(16, 'little')).hex()}.kv"
    path.write_bytes(b"\x00" * 100)        # torn on disk
    with pytest.raises(NotFound):
        store.read(NS, 1)
    s = store.stats()
    assert (s.corrupt_blocks, s.disk_blocks, s.disk_used_bytes) == (1, 0, 0)
    store.check_integrity()


def test_bad_keys_are_invalid_arguments():
    store = KVStore(memory_bytes=100)
    with pytest.raises(InvalidArgument, match="namespace"):
        store.lookup(b"short", [1])
    with pytest.raises(InvalidArgument, match="128-bit"):
        store.lookup(NS, [1 << 128])
    with pytest.raises(InvalidArgument, match="owner"):
        store.acquire("", NS, [1])


def test_placement_events_snapshot_and_deltas(tmp_path):
    store = KVStore(memory_bytes=100, disk_dir=tmp_path, disk_bytes=100, max_events=4)
    put(store, 1)
    put(store, 2)   # 1 -> disk
    put(store, 3)   # 2 -> disk, 1 removed
    assert store.events.since(0) is None          # seq 1-2 are no longer retained: snapshot
    cursor, blocks = store.snapshot()
    assert cursor == store.events.cursor == 6
    assert blocks == [(NS, 3, "memory"), (NS, 2, "disk")]
    tail = store.events.since(2)
    assert [(e.seq, e.kind, e.block_hash, e.tier) for e in tail] == [
        (3, PlacementKind.STORED, 2, "memory"), (4, PlacementKind.REMOVED, 1, "disk"),
        (5, PlacementKind.MOVED, 2, "disk"), (6, PlacementKind.STORED, 3, "memory")]
    assert store.events.since(6) == [] and store.events.since(7) is None


def test_chunks_cover_the_payload():
    data = bytes(range(256)) * 10
    parts = list(chunks(data, 1000))
    assert [len(p) for p in parts] == [1000, 1000, 560] and b"".join(parts) == data
    assert list(chunks(b"")) == [b""]
