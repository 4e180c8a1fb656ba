"""The kvstore's Prometheus metrics: the store's own counters (``StoreStats``, read
at scrape time) plus what the servicer sees of each call.

=============================================  =========  ===========================================
metric                                         type       source
=============================================  =========  ===========================================
meshserve_kvstore_requested_blocks_total       counter    blocks asked for by Lookup and Get
meshserve_kvstore_found_blocks_total           counter    of those, the stored prefix found
meshserve_kvstore_hit_ratio                    gauge      found / requested blocks since start
meshserve_kvstore_get_seconds                  histogram  one Get (fetch) call, start to last chunk
meshserve_kvstore_hit_blocks_total             counter    ``hit_blocks`` (lookups and leases)
meshserve_kvstore_misses_total                 counter    ``miss_blocks``: calls that stopped at a
                                                          missing block
meshserve_kvstore_received_bytes_total         counter    ``bytes_in``: payload bytes put
meshserve_kvstore_sent_bytes_total             counter    ``bytes_out``: payload bytes read
meshserve_kvstore_blocks_stored_total          counter    ``blocks_stored``
meshserve_kvstore_evictions_total{tier}        counter    ``memory_evictions``, ``disk_evictions``
meshserve_kvstore_blocks_removed_total         counter    ``blocks_removed``
meshserve_kvstore_rejected_puts_total          counter    ``rejected_no_space``
meshserve_kvstore_corrupt_blocks_total         counter    ``corrupt_blocks``
meshserve_kvstore_used_bytes{tier}             gauge      payload bytes stored per tier
meshserve_kvstore_capacity_bytes{tier}         gauge      byte budget per tier (disk 0 without one)
meshserve_kvstore_blocks{tier}                 gauge      blocks stored per tier
meshserve_kvstore_leases                       gauge      (owner, block) leases held now
=============================================  =========  ===========================================
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.store import KVStore
from meshserve.metrics import FAST_BUCKETS, new_registry, snapshot


def _tiers(name: str, doc: str, memory: float, disk: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["tier"])
    family.add_metric(["memory"], memory)
    family.add_metric(["disk"], disk)
    return family


class KVStoreMetrics(Collector):
    """The kvstore's metrics over one ``KVStore``.

    Args:
        store: the store (its ``stats()`` is read from the scrape thread: a snapshot
            of plain integers).
        registry: where to register (default: a new ``new_registry("kvstore")``).
    """

    def __init__(self, store: KVStore, registry: CollectorRegistry | None = None):
        self.store = store
        self.registry = registry if registry is not None else new_registry("kvstore")
        r = self.registry
        self.requested_blocks = 0
        self.found_blocks = 0
        self.get_seconds = Histogram("meshserve_kvstore_get_seconds", "One Get call, start to its last chunk.",
                                     registry=r, buckets=FAST_BUCKETS)
        r.register(self)

    def on_query(self, requested: int, found: int) -> None:
        """A Lookup or Get asked for ``requested`` blocks and found a prefix of ``found``."""
        self.requested_blocks += requested
        self.found_blocks += found

    def collect(self) -> Iterator:
        s = snapshot(self.store.stats)
        requested, found = self.requested_blocks, self.found_blocks
        yield CounterMetricFamily("meshserve_kvstore_requested_blocks", "Blocks asked for by Lookup and Get.",
                                  value=requested)
        yield CounterMetricFamily("meshserve_kvstore_found_blocks", "Blocks found (the stored prefix) by Lookup "
                                  "and Get.", value=found)
        yield GaugeMetricFamily("meshserve_kvstore_hit_ratio", "Found / requested blocks since start.",
                                value=found / requested if requested else 0.0)
        for name, doc, value in (
            ("meshserve_kvstore_hit_blocks", "Blocks found by lookups and leases.", s.hit_blocks),
            ("meshserve_kvstore_misses", "Lookups and leases that stopped at a missing block.", s.miss_blocks),
            ("meshserve_kvstore_received_bytes", "Payload bytes accepted by Put.", s.bytes_in),
            ("meshserve_kvstore_sent_bytes", "Payload bytes returned by Get.", s.bytes_out),
            ("meshserve_kvstore_blocks_stored", "Puts that stored a new block.", s.blocks_stored),
            ("meshserve_kvstore_blocks_removed", "Blocks that left the store.", s.blocks_removed),
            ("meshserve_kvstore_rejected_puts", "Puts refused for lack of room.", s.rejected_no_space),
            ("meshserve_kvstore_corrupt_blocks", "Blocks dropped on a checksum mismatch.", s.corrupt_blocks),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        evictions = CounterMetricFamily("meshserve_kvstore_evictions", "Blocks evicted from a tier to make room.",
                                        labels=["tier"])
        evictions.add_metric(["memory"], s.memory_evictions)
        evictions.add_metric(["disk"], s.disk_evictions)
        yield evictions
        yield _tiers("meshserve_kvstore_used_bytes", "Payload bytes stored.", s.memory_used_bytes, s.disk_used_bytes)
        yield _tiers("meshserve_kvstore_capacity_bytes", "Byte budget.", s.memory_capacity_bytes,
                     s.disk_capacity_bytes)
        yield _tiers("meshserve_kvstore_blocks", "Blocks stored.", s.memory_blocks, s.disk_blocks)
        yield GaugeMetricFamily("meshserve_kvstore_leases", "(owner, block) leases held now.", value=s.num_leases)
