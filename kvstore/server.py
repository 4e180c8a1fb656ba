"""The KVStore gRPC servicer: a thin layer over ``kvstore.store.KVStore``.

Converts proto ↔ domain, validates what the caller sent (fingerprints, hashes,
payload sizes, checksums: ``INVALID_ARGUMENT``), moves payloads in chunks, ties
each Get's leases to its stream (released in ``finally``, so a cancelled or
failed transfer releases them too), and streams placement events. Every call
opens a span under the caller's trace context.

**Put buffers are bounded.** A block's size is checked against the layout its
fingerprint names before any of its bytes are taken; a block larger than the
whole memory tier is refused at once (INVALID_ARGUMENT: it could never be
stored), and the bytes of blocks being received, over all Put calls together,
never exceed the memory tier's budget (RESOURCE_EXHAUSTED with a retry delay).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time

from opentelemetry.trace import SpanKind

from kvstore.events import PlacementKind
from kvstore.metrics import KVStoreMetrics
from kvstore.store import KVStore, PutStatus
from meshserve.block_hash import hash_to_bytes
from meshserve.errors import InvalidArgument, NotFound, ResourceExhausted
from meshserve.grpc_server import Service
from meshserve.kvstore_payload import chunks
from meshserve.kvstore_wire import fingerprint_from_proto, hashes_from_proto
from meshserve.telemetry import context_from_grpc, tracer
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Serves one ``KVStore``.

    Args:
        store: the core (single-threaded: used from this server's event loop only).
    """

    def __init__(self, store: KVStore):
        self.store = store
        self.metrics = KVStoreMetrics(store)
        self._call_ids = itertools.count()
        self._watchers: set[asyncio.Event] = set()
        self.max_buffered_bytes = store.memory.capacity  # payload bytes of Put blocks in flight, all calls
        self.buffered_bytes = 0
        store.events.listeners.append(self._notify)

    def _notify(self, _event) -> None:
        for wake in self._watchers:
            wake.set()

    async def Lookup(self, request, context) -> kvstore_pb2.LookupResponse:
        fp = fingerprint_from_proto(request.fingerprint)
        hashes = hashes_from_proto(request.block_hashes)
        n = self.store.lookup(fp.namespace, hashes)
        self.metrics.on_query(len(hashes), n)
        return kvstore_pb2.LookupResponse(num_blocks=n)

    async def Get(self, request, context):
        fp = fingerprint_from_proto(request.fingerprint)
        hashes = hashes_from_proto(request.block_hashes)
        owner = f"{request.lease_owner or 'anonymous'}#{next(self._call_ids)}"
        # not attached as the current span: a generator
        span = _tracer.start_span("kvstore.get", context=context_from_grpc(context), kind=SpanKind.SERVER)
        started = time.perf_counter()
        n = self.store.acquire(owner, fp.namespace, hashes)
        self.metrics.on_query(len(hashes), n)
        span.set_attributes({"meshserve.kvstore.requested_blocks": len(hashes), "meshserve.kvstore.found_blocks": n})
        try:
            yield kvstore_pb2.GetResponse(num_blocks=n)
            for block_hash in hashes[:n]:
                try:
                    data, crc = self.store.read(fp.namespace, block_hash)
                except NotFound:
                    return  # dropped as corrupt on disk: the caller gets a shorter prefix
                header = kvstore_pb2.BlockHeader(block_hash=hash_to_bytes(block_hash), num_bytes=len(data),
                                                 checksum=crc)
                for i, chunk in enumerate(chunks(data)):
                    msg = kvstore_pb2.GetResponse(data=chunk)
                    if i == 0:
                        msg.header.CopyFrom(header)
                    yield msg
        finally:
            self.store.release(owner)
            self.metrics.get_seconds.observe(time.perf_counter() - started)
            span.end()

    async def Put(self, request_iterator, context) -> kvstore_pb2.PutResponse:
        with _tracer.start_as_current_span("kvstore.put", context=context_from_grpc(context),
                                           kind=SpanKind.SERVER) as span:
            put = _PutState()
            try:
                async for msg in request_iterator:
                    self._put_message(msg, put)
            finally:
                self.buffered_bytes -= put.reserved
            if put.header is not None:
                raise InvalidArgument(f"block {put.header.block_hash.hex()} ended after {len(put.buf)} of "
                                      f"{put.header.num_bytes} bytes (not stored)")
            span.set_attribute("meshserve.kvstore.stored_blocks", put.counts[PutStatus.STORED])
            return kvstore_pb2.PutResponse(num_stored=put.counts[PutStatus.STORED],
                                           num_existing=put.counts[PutStatus.EXISTS],
                                           num_no_space=put.counts[PutStatus.NO_SPACE])

    def _reserve(self, put: _PutState, num_bytes: int) -> None:
        """Counts ``num_bytes`` of a block about to be received against the buffer budget.

        Raises:
            InvalidArgument: the block is larger than the memory tier.
            ResourceExhausted: blocks in flight already hold the budget.
        """
        if num_bytes > self.max_buffered_bytes:
            raise InvalidArgument(f"block of {num_bytes} bytes exceeds the kvstore's memory budget of "
                                  f"{self.max_buffered_bytes} bytes")
        if self.buffered_bytes + num_bytes > self.max_buffered_bytes:
            raise ResourceExhausted(f"kvstore is receiving {self.buffered_bytes} bytes of blocks; its buffer "
                                    f"budget is {self.max_buffered_bytes} bytes", 1.0)
        self.buffered_bytes += num_bytes
        put.reserved += num_bytes

    def _put_message(self, msg: kvstore_pb2.PutRequest, put: _PutState) -> None:
        """Takes one Put message into ``put``; stores the block it completes."""
        if put.fp is None:
            if not msg.HasField("fingerprint"):
                raise InvalidArgument("the first Put message must carry the fingerprint")
            put.fp = fingerprint_from_proto(msg.fingerprint)
        if msg.HasField("header"):
            if put.header is not None:
                raise InvalidArgument(f"block {put.header.block_hash.hex()} ended after {len(put.buf)} of "
                                      f"{put.header.num_bytes} bytes")
            put.header, put.buf = self._check_header(msg.header, put.fp.block_bytes), bytearray()
            self._reserve(put, put.header.num_bytes)
        elif put.header is None and msg.data:
            raise InvalidArgument("payload data before any block header")
        header = put.header
        if header is not None and not put.buf and len(msg.data) == header.num_bytes:
            put.buf = msg.data  # the whole block in one message (the usual case): no copy
        else:
            put.buf += msg.data
        if header is not None and len(put.buf) >= header.num_bytes:
            if len(put.buf) > header.num_bytes:
                raise InvalidArgument(f"block {header.block_hash.hex()}: more than num_bytes "
                                      f"{header.num_bytes} of payload")
            block_hash = hashes_from_proto([header.block_hash])[0]
            data = put.buf if isinstance(put.buf, bytes) else bytes(put.buf)
            put.counts[self.store.put(put.fp.namespace, block_hash, data, header.checksum)] += 1
            self.buffered_bytes -= put.reserved
            put.header, put.buf, put.reserved = None, bytearray(), 0

    @staticmethod
    def _check_header(header: kvstore_pb2.BlockHeader, block_bytes: int) -> kvstore_pb2.BlockHeader:
        hashes_from_proto([header.block_hash])
        if header.num_bytes != block_bytes:
            raise InvalidArgument(f"block {header.block_hash.hex()}: num_bytes {header.num_bytes} does not match "
                                  f"the fingerprint's layout ({block_bytes} bytes per block)")
        return header

    async def Stats(self, request, context) -> kvstore_pb2.KVStoreStatsResponse:
        return kvstore_pb2.KVStoreStatsResponse(**dataclasses.asdict(self.store.stats()),
                                                placement_cursor=self.store.events.cursor)

    async def WatchPlacements(self, request, context):
        wake = asyncio.Event()
        self._watchers.add(wake)
        try:
            cursor, need_snapshot = request.cursor, request.cursor == 0  # 0: the caller holds nothing yet
            while True:
                wake.clear()
                events = None if need_snapshot else self.store.events.since(cursor)
                if events is None:
                    need_snapshot = False  # an empty store's cursor is 0 too: it waits after its snapshot
                    cursor, blocks = self.store.snapshot()
                    for ns, block_hash, tier in blocks:
                        yield kvstore_pb2.PlacementEvent(seq=cursor, kind=PlacementKind.STORED, namespace=ns,
                                                         block_hash=hash_to_bytes(block_hash), tier=tier,
                                                         snapshot=True)
                    yield kvstore_pb2.PlacementEvent(seq=cursor, kind=kvstore_pb2.PLACEMENT_KIND_SNAPSHOT_END,
                                                     snapshot=True)
                    continue
                for e in events:
                    yield kvstore_pb2.PlacementEvent(seq=e.seq, kind=int(e.kind), namespace=e.namespace,
                                                     block_hash=hash_to_bytes(e.block_hash), tier=e.tier)
                    cursor = e.seq
                if cursor == self.store.events.cursor:
                    await wake.wait()
        finally:
            self._watchers.discard(wake)


@dataclasses.dataclass
class _PutState:
    """One Put call's progress: its fingerprint, the block being received, its bytes,
    the buffer bytes it reserved, and what happened to its blocks so far."""

    fp: object = None
    header: kvstore_pb2.BlockHeader | None = None
    buf: bytes | bytearray = dataclasses.field(default_factory=bytearray)
    reserved: int = 0
    counts: dict = dataclasses.field(
        default_factory=lambda: {PutStatus.STORED: 0, PutStatus.EXISTS: 0, PutStatus.NO_SPACE: 0})


async def start_kvstore(store: KVStore, port: int, host: str = "127.0.0.1",
                        servicer_cls: type[KVStoreServicer] = KVStoreServicer,
                        metrics_port: int | None = None, tls: TLSConfig = PLAINTEXT,
                        health_port: int | None = None) -> Service:
    """Starts the KVStore service over ``store``; SERVING at once (nothing to warm).

    Args:
        servicer_cls: the servicer class (tests pass a fault-injecting subclass).
        metrics_port: serve Prometheus metrics (``kvstore.metrics``) there as
            ``service.metrics`` (0: a free port; None: none).
        tls: its certificate (role kvstore), or plaintext.
        health_port: a plaintext health-only port (``Service``; None: none).

    Raises:
        OSError: the port cannot be bound.
    """
    service = Service("meshserve.v1.KVStore", port, host, tls, health_port=health_port)
    servicer = servicer_cls(store)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, service.server)
    service.serve_metrics(servicer.metrics.registry, metrics_port)
    await service.start()
    await service.set_serving(True)
    service.servicer = servicer  # type: ignore[attr-defined]
    return service
