"""kvstore: prefix KV blocks shared by executors.

``store`` (the pure core: tiers, LRU, leases, checksums, placement events),
``tiers`` (memory and disk storage), ``events`` (the placement log), ``server``
(the gRPC servicer), ``metrics``. Shared with its clients, in ``meshserve``: the
payload framing (``meshserve.kvstore_payload``: checksums and chunks), the proto
conversions (``meshserve.kvstore_wire``) and the asyncio client
(``meshserve.kvstore_client``); the benchmark is ``meshserve.bench.kvstore_sharing``.
"""
