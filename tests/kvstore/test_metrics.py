"""kvstore.metrics over a real KVStore: the store's counters as they are, plus the
servicer's per-call figures."""

from kvstore.metrics import KVStoreMetrics
from kvstore.store import KVStore
from meshserve.kvstore_payload import checksum

NS = bytes(range(16))


def test_kvstore_metrics_follow_the_store(tmp_path):
    store = KVStore(memory_bytes=200, disk_dir=tmp_path, disk_bytes=100)
    m = KVStoreMetrics(store)
    get = m.registry.get_sample_value
    for h in (1, 2, 3, 4):  # 100 bytes each: 3 demotes 1 to disk, 4 demotes 2 and drops 1
        data = bytes([h]) * 100
        store.put(NS, h, data, checksum(data))
    m.on_query(4, store.lookup(NS, [3, 4, 5, 6]))  # finds 3, 4
    store.read(NS, 3)
    m.get_seconds.observe(0.002)
    assert get("meshserve_kvstore_requested_blocks_total") == 4
    assert get("meshserve_kvstore_found_blocks_total") == 2
    assert get("meshserve_kvstore_hit_ratio") == 0.5
    assert get("meshserve_kvstore_hit_blocks_total") == 2  # the lookup's
    assert get("meshserve_kvstore_misses_total") == 1
    assert get("meshserve_kvstore_received_bytes_total") == 400
    assert get("meshserve_kvstore_sent_bytes_total") == 100
    assert get("meshserve_kvstore_blocks_stored_total") == 4
    assert get("meshserve_kvstore_evictions_total", {"tier": "memory"}) == 2
    assert get("meshserve_kvstore_evictions_total", {"tier": "disk"}) == 1
    assert get("meshserve_kvstore_blocks_removed_total") == 1
    assert get("meshserve_kvstore_used_bytes", {"tier": "memory"}) == 200
    assert get("meshserve_kvstore_used_bytes", {"tier": "disk"}) == 100
    assert get("meshserve_kvstore_capacity_bytes", {"tier": "disk"}) == 100
    assert get("meshserve_kvstore_blocks", {"tier": "memory"}) == 2
    assert get("meshserve_kvstore_leases") == 0
    assert get("meshserve_kvstore_get_seconds_count") == 1
