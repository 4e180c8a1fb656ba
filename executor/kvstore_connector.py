"""KVStoreConnector: the engine's ``KVConnector`` over the kvstore's gRPC API.

All network work runs on the connector's own I/O thread (its own asyncio loop
and channel), so neither the engine thread nor the executor's gRPC loop ever
waits on the kvstore::

    engine thread ── start_fetch / cancel / publish ──▶ run_coroutine_threadsafe ──▶ I/O loop
    engine thread ◀── poll() ── SimpleQueue of FetchResult ◀── a fetch finishes (wake())

Fetches: one ``Get`` per request (the store leases the blocks for the
stream); payloads are verified against their CRC-32 and the layout's size; a
failed call, a corrupt block or a cancelled fetch shortens the usable prefix,
never the output's correctness. Publishes: queued with a byte bound
(``max_publish_bytes``): when the bound is reached new blocks are dropped
(counted), so decode never waits for the store; at most ``max_inflight_puts``
``Put`` streams run at once. Spans ``executor.kvstore_fetch`` and
``executor.kvstore_publish`` are children of the request's span.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import Callable, Sequence

import grpc
from opentelemetry.trace import SpanKind

from executor.engine.kv_connector import FetchResult, KVConnector, KVConnectorStats
from meshserve.block_hash import BlockHash, KVStoreFingerprint
from meshserve.kvstore_client import KVStoreClient
from meshserve.telemetry import outgoing_metadata, tracer
from meshserve.timeouts import wait_for
from meshserve.tls import PLAINTEXT, TLSConfig

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

_KNOWN_HASHES = 65536  # recently fetched or published hashes remembered (not re-published)


class KVStoreConnector(KVConnector):
    """A ``KVConnector`` to the kvstore at ``address``.

    Args:
        address: host:port of the KVStore service.
        fingerprint: the engine's ``kv_store_fingerprint``.
        fetch_timeout_s: seconds the engine waits for a fetch before recomputing (> 0).
        max_publish_bytes: payload bytes queued or in flight for publishing, at most.
        max_inflight_puts: concurrent Put streams.
        tls: the executor's TLS settings (role executor), or plaintext.

    Raises:
        ValueError: a bad timeout or bound.
    """

    def __init__(self, address: str, fingerprint: KVStoreFingerprint, fetch_timeout_s: float = 5.0,
                 max_publish_bytes: int = 256 << 20, max_inflight_puts: int = 2, tls: TLSConfig = PLAINTEXT):
        if not fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {fetch_timeout_s}")
        if max_publish_bytes < 0 or max_inflight_puts < 1:
            raise ValueError("max_publish_bytes must be >= 0 and max_inflight_puts >= 1")
        self.address = address
        self.tls = tls
        self.fingerprint = fingerprint
        self.fetch_timeout_s = fetch_timeout_s
        self.max_publish_bytes = max_publish_bytes
        self._block_bytes = fingerprint.block_bytes
        self._done: queue.SimpleQueue = queue.SimpleQueue()     # (fetch id, FetchResult)
        # request id -> (fetch id, future) of its current fetch; engine thread only. A result
        # whose fetch id is not its request's current one was cancelled: never reported
        self._fetches: dict[str, tuple[int, concurrent.futures.Future]] = {}
        self._fetch_ids = itertools.count()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()
        self._lock = threading.Lock()                               # _known, _counters, _publish_bytes
        self._counters = KVConnectorStats()
        self._publish_bytes = 0
        self._publishes: set[concurrent.futures.Future] = set()
        self._wake: Callable[[], None] = lambda: None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-io", daemon=True)
        self._thread.start()
        self._client: KVStoreClient = self._call(self._make_client(max_inflight_puts))

    async def _make_client(self, max_inflight_puts: int) -> KVStoreClient:
        self._put_slots = asyncio.Semaphore(max_inflight_puts)
        return KVStoreClient(self.address, self.tls)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Cancels fetches, drops unsent publishes, closes the channel, stops the thread."""
        for future in [f for _, f in self._fetches.values()] + list(self._publishes):
            future.cancel()
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- counters -------------------------------------------------------------

    def _count(self, **deltas) -> None:
        with self._lock:
            values = asdict(self._counters)
            for name, delta in deltas.items():
                values[name] += delta
            self._counters = KVConnectorStats(**values)

    def stats(self) -> KVConnectorStats:
        return self._counters

    def note_fetch_given_up(self) -> None:
        self._count(fetch_failures=1)

    def set_waker(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def _remember(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                self._known[block_hash] = None
                self._known.move_to_end(block_hash)
            while len(self._known) > _KNOWN_HASHES:
                self._known.popitem(last=False)

    def is_known(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._known

    # -- fetch ----------------------------------------------------------------

    def start_fetch(self, request_id: str, start_block: int, block_hashes: Sequence[BlockHash],
                    trace_context: object = None) -> None:
        self.cancel(request_id)  # a fetch still in flight under this id is not the request's any more
        fetch_id = next(self._fetch_ids)
        self._fetches[request_id] = (fetch_id, asyncio.run_coroutine_threadsafe(
            self._fetch(fetch_id, request_id, start_block, list(block_hashes), trace_context), self._loop))

    def poll(self) -> list[FetchResult]:
        """Finished fetches; one cancelled after it finished (its result already queued)
        is dropped here, so a new fetch under the same request id never gets its result."""
        results = []
        while not self._done.empty():
            fetch_id, result = self._done.get()
            current = self._fetches.get(result.request_id)
            if current is None or current[0] != fetch_id:
                continue  # cancelled: the request was aborted, given up or fetches again
            del self._fetches[result.request_id]  # finished: nothing left to cancel
            results.append(result)
        return results

    def cancel(self, request_id: str) -> None:
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None:
            fetch[1].cancel()  # cancels the Get: the store releases the request's leases

    async def _fetch(self, fetch_id: int, request_id: str, start_block: int, hashes: list[BlockHash],
                     trace_context) -> None:
        span = _tracer.start_span("executor.kvstore_fetch", context=trace_context, kind=SpanKind.CLIENT)
        span.set_attributes({"meshserve.request_id": request_id, "meshserve.kvstore.requested_blocks": len(hashes)})
        started = time.monotonic()
        payloads: list = []
        try:
            result = await self._client.get(self.fingerprint, hashes, lease_owner=request_id,
                                            metadata=outgoing_metadata(span), timeout=self.fetch_timeout_s)
            for payload in result.payloads:  # the store checked sizes; a stranger's store might not have
                if len(payload) != self._block_bytes:
                    break
                payloads.append(payload)
            failed = result.num_corrupt > 0 or len(payloads) < len(result.payloads)
            self._count(fetches=1, fetched_blocks=len(payloads), bytes_in=result.num_bytes,
                        corrupt_blocks=result.num_corrupt, fetch_failures=int(failed),
                        fetch_seconds=time.monotonic() - started)
            self._remember(hashes[:len(payloads)])
            self._forget(hashes[len(payloads):])  # gone from the store (evicted, restarted): publish again
            span.set_attributes({"meshserve.kvstore.fetched_blocks": len(payloads),
                                 "meshserve.kvstore.corrupt_blocks": result.num_corrupt})
        except asyncio.CancelledError:
            span.set_attribute("meshserve.kvstore.cancelled", True)
            span.end()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means recompute, never a crash
            name = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            log.warning("kvstore fetch for %s failed (%s): recomputing", request_id, name)
            self._count(fetches=1, fetch_failures=1, fetch_seconds=time.monotonic() - started)
            span.set_attribute("meshserve.kvstore.error", name)
            payloads = []
        span.end()
        self._done.put((fetch_id, FetchResult(request_id, start_block, payloads, len(hashes))))
        self._wake()

    # -- publish --------------------------------------------------------------

    def publish(self, blocks: Sequence[tuple[BlockHash, bytes]], trace_context: object = None) -> None:
        size = len(blocks) * self._block_bytes
        with self._lock:
            if self._publish_bytes + size > self.max_publish_bytes:
                dropped = True
            else:
                dropped = False
                self._publish_bytes += size
        if dropped:
            self._count(publish_dropped_blocks=len(blocks))
            return
        self._remember([h for h, _ in blocks])
        future = asyncio.run_coroutine_threadsafe(self._publish(list(blocks), size, trace_context), self._loop)
        self._publishes.add(future)
        future.add_done_callback(self._publishes.discard)

    async def _publish(self, blocks: list[tuple[BlockHash, bytes]], size: int, trace_context) -> None:
        span = _tracer.start_span("executor.kvstore_publish", context=trace_context, kind=SpanKind.CLIENT)
        span.set_attribute("meshserve.kvstore.blocks", len(blocks))
        try:
            async with self._put_slots:
                resp = await self._client.put(self.fingerprint, blocks, metadata=outgoing_metadata(span), timeout=60)
            self._count(published_blocks=resp.num_stored + resp.num_existing, bytes_out=size,
                        publish_dropped_blocks=resp.num_no_space)
            if resp.num_no_space:  # which were refused is not said: offer them all again later
                self._forget([h for h, _ in blocks])
            span.set_attributes({"meshserve.kvstore.stored_blocks": resp.num_stored,
                                 "meshserve.kvstore.no_space_blocks": resp.num_no_space})
        except Exception as exc:  # noqa: BLE001 - a lost publish only costs a later recompute
            name = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            log.warning("kvstore publish of %d blocks failed (%s)", len(blocks), name)
            self._count(publish_dropped_blocks=len(blocks))
            self._forget([h for h, _ in blocks])
            span.set_attribute("meshserve.kvstore.error", name)
        finally:
            with self._lock:
                self._publish_bytes -= size
            span.end()

    def _forget(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                self._known.pop(block_hash, None)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Waits until the channel to the kvstore is connected (tests, benchmarks).

        Raises:
            TimeoutError: not connected within ``timeout_s``.
        """
        async def ready():
            await wait_for(self._client.channel.channel_ready(), timeout_s)
        self._call(ready())

    def flush(self, timeout_s: float = 30.0) -> None:
        """Waits until every queued publish is done (tests and benchmarks).

        Raises:
            TimeoutError: publishes still running after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self._publishes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._publishes)} kvstore publishes still running")
            time.sleep(0.005)
