"""The scheduler's follower of the kvstore's placement stream (``WatchPlacements``).

Keeps ``scheduler.kvstore_index.KVStoreIndex`` up to date: connects and asks for
the events from cursor 0 (the kvstore answers with a snapshot of its contents,
then deltas), applies each event, and on a broken stream clears the index (a
kvstore that cannot be reached cannot serve fetches; a restarted one lost its
memory tier) and reconnects after ``retry_s`` seconds, again from a snapshot.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from meshserve.background import BackgroundTask
from meshserve.kvstore_client import KVStoreClient
from meshserve.tls import PLAINTEXT, TLSConfig
from scheduler.kvstore_index import KVStoreIndex

log = logging.getLogger(__name__)


class KVStoreFollower(BackgroundTask):
    """Follows ``address``'s placement events into ``index`` until stopped.

    Args:
        address: host:port of the kvstore.
        index: the index to keep (the admission core's).
        retry_s: seconds between reconnection attempts.
        tls: the scheduler's TLS settings (plaintext by default).
    """

    def __init__(self, address: str, index: KVStoreIndex, retry_s: float = 1.0, tls: TLSConfig = PLAINTEXT):
        self.address = address
        self.tls = tls
        self.index = index
        self.retry_s = retry_s
        self.connected = asyncio.Event()  # set while a stream is open (tests wait on it)

    async def _run(self) -> None:
        client = KVStoreClient(self.address, self.tls)
        try:
            while True:
                try:
                    async for event in client.watch(0):
                        self.connected.set()
                        self.index.apply(event.seq, event.kind, bytes(event.namespace), bytes(event.block_hash),
                                         event.snapshot)
                    log.warning("kvstore %s ended the placement stream", self.address)
                except grpc.aio.AioRpcError as exc:
                    log.warning("kvstore %s placement stream: %s", self.address, exc.code().name)
                self.connected.clear()
                self.index.clear()
                await asyncio.sleep(self.retry_s)
        finally:
            await client.close()
