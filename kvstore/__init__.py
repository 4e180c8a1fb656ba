"""kvstore: prefix KV blocks shared by executors.

``store`` (the pure core: tiers, LRU, leases, checksums, placement events),
``tiers`` (memory and disk storage), ``events`` (the placement log), ``payload``
(checksums and chunks), ``wire`` (proto conversions), ``server`` (the gRPC
servicer), ``client`` (the asyncio client), ``bench`` (the benchmark).
"""
