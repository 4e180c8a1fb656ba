"""A kvstore service on its own thread and event loop, for tests that drive engines
synchronously (the engine's connector has its own I/O thread too), plus the
fault-injecting wrappers around the real store and servicer."""

from __future__ import annotations

import asyncio
import threading

from kvstore.server import KVStoreServicer, start_kvstore
from kvstore.store import KVStore, PutStatus


class ServedKVStore:
    """Serves ``store`` on 127.0.0.1 from a background thread until ``stop()``.

    Args:
        store: the real core (or a fault-injecting subclass).
        port: 0 for a free port; a fixed port to restart on the same address.
        servicer_cls: ``KVStoreServicer`` or a delaying subclass.
    """

    def __init__(self, store: KVStore, port: int = 0, servicer_cls=KVStoreServicer):
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-test", daemon=True)
        self._thread.start()
        self.service = self.call(start_kvstore(store, port, servicer_cls=servicer_cls))
        self.address = self.service.address
        self.port = self.service.port

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def stats(self):
        """The store's counters, read on its own loop."""
        async def read():
            return self.store.stats()
        return self.call(read())

    def stop(self) -> None:
        self.call(self.service.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class CorruptingStore(KVStore):
    """Returns flipped bytes (with the original checksum) for the blocks in ``corrupt``."""

    corrupt: set[int]

    def read(self, namespace, block_hash):
        data, crc = super().read(namespace, block_hash)
        if block_hash in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data, crc


class DroppingStore(KVStore):
    """Refuses to store the blocks in ``drop`` (a block missing in the middle of a chain)."""

    drop: set[int]

    def put(self, namespace, block_hash, data, data_checksum):
        if block_hash in self.drop:
            return PutStatus.NO_SPACE
        return super().put(namespace, block_hash, data, data_checksum)


STALL_S = 3600.0  # a delay no test waits out: a call stalled by it ends when it is cancelled


class DelayingServicer(KVStoreServicer):
    """The real servicer with delays: ``get_delay_s`` between Get messages and
    ``put_ack_delay_s`` before each Put acknowledgement; with ``put_ack_gate`` (an
    ``asyncio.Event`` of the servicer's own loop) each acknowledgement also waits
    until the test sets it."""

    get_delay_s = 0.0
    put_ack_delay_s = 0.0
    put_ack_gate: asyncio.Event | None = None

    async def Get(self, request, context):
        async for msg in super().Get(request, context):
            yield msg
            await asyncio.sleep(self.get_delay_s)

    async def Put(self, request_iterator, context):
        response = await super().Put(request_iterator, context)
        await asyncio.sleep(self.put_ack_delay_s)
        if self.put_ack_gate is not None:
            await self.put_ack_gate.wait()
        return response


class RecordingStore(KVStore):
    """The real store, remembering the size of every block it is asked to put."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.put_sizes: list[int] = []

    def put(self, namespace, block_hash, data, data_checksum):
        self.put_sizes.append(len(data))
        return super().put(namespace, block_hash, data, data_checksum)


class RecordingServicer(KVStoreServicer):
    """The real servicer, remembering the fingerprint (block metadata) each Put carried."""

    def __init__(self, store):
        super().__init__(store)
        self.put_fingerprints: list = []

    def _put_message(self, msg, put) -> None:
        first = put.fp is None
        super()._put_message(msg, put)
        if first:
            self.put_fingerprints.append(put.fp)
