"""An asyncio client of the KVStore service (the executor's connector uses it).

Payloads are verified here, on arrival: a block whose bytes fail its CRC-32 is
reported as corrupt and ends the usable prefix (the caller recomputes from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from meshserve.block_hash import KVStoreFingerprint, hash_to_bytes
from meshserve.grpc_server import CHANNEL_OPTIONS, open_channel
from meshserve.kvstore_payload import checksum, chunks
from meshserve.kvstore_wire import fingerprint_to_proto
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc


@dataclass
class GetResult:
    """The verified prefix of a Get.

    Attributes:
        payloads: payloads (``bytearray``) of the leading blocks that arrived whole
            with a matching checksum, in chain order.
        num_found: blocks the store had (and leased) for this call.
        num_corrupt: 1 when the prefix ended at a block that failed its checksum, else 0.
        num_bytes: payload bytes received.
    """

    payloads: list[bytes]
    num_found: int
    num_corrupt: int
    num_bytes: int


class KVStoreClient:
    """One channel to a kvstore.

    Args:
        address: host:port of the KVStore service.
        tls: the caller's TLS settings (its role's certificate), or plaintext.
    """

    def __init__(self, address: str, tls: TLSConfig = PLAINTEXT):
        self.address = address
        self.channel = open_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def lookup(self, fp: KVStoreFingerprint, block_hashes: Sequence[int], timeout: float | None = None) -> int:
        """Blocks of the longest stored prefix of ``block_hashes``."""
        req = kvstore_pb2.LookupRequest(fingerprint=fingerprint_to_proto(fp),
                                        block_hashes=[hash_to_bytes(h) for h in block_hashes])
        return (await self.stub.Lookup(req, timeout=timeout)).num_blocks

    async def get(self, fp: KVStoreFingerprint, block_hashes: Sequence[int], lease_owner: str = "",
                  metadata: tuple = (), timeout: float | None = None) -> GetResult:
        """Reads the longest stored prefix of ``block_hashes`` (leased while streaming).

        Raises:
            grpc.aio.AioRpcError: the call failed (unreachable store, deadline…).
        """
        req = kvstore_pb2.GetRequest(fingerprint=fingerprint_to_proto(fp),
                                     block_hashes=[hash_to_bytes(h) for h in block_hashes], lease_owner=lease_owner)
        result = GetResult([], 0, 0, 0)
        expected = iter(block_hashes)
        header, buf = None, bytearray()
        call = self.stub.Get(req, metadata=metadata, timeout=timeout)
        try:
            async for msg in call:
                if msg.num_blocks:
                    result.num_found = msg.num_blocks
                if msg.HasField("header"):
                    header, buf = msg.header, bytearray()
                    want = next(expected, None)
                    if want is None or header.block_hash != hash_to_bytes(want):
                        break  # not the block asked for next: keep the prefix so far
                if header is None:
                    continue
                buf += msg.data
                result.num_bytes += len(msg.data)
                if len(buf) >= header.num_bytes:
                    if len(buf) != header.num_bytes or checksum(buf) != header.checksum:
                        result.num_corrupt = 1
                        break
                    result.payloads.append(buf)  # a bytearray: writable, so torch.frombuffer takes it as is
                    header, buf = None, bytearray()
        finally:
            call.cancel()  # no-op when complete; releases the leases at once when we stop early
        return result

    async def put(self, fp: KVStoreFingerprint, blocks: Sequence[tuple[int, bytes]], metadata: tuple = (),
                  timeout: float | None = None) -> kvstore_pb2.PutResponse:
        """Stores ``(block_hash, payload)`` pairs in one stream.

        Raises:
            grpc.aio.AioRpcError: INVALID_ARGUMENT (wrong size for the layout…) or a failed call.
        """
        fp_msg = fingerprint_to_proto(fp)

        def messages():
            first = True
            for block_hash, data in blocks:
                header = kvstore_pb2.BlockHeader(block_hash=hash_to_bytes(block_hash), num_bytes=len(data),
                                                 checksum=checksum(data))
                for i, chunk in enumerate(chunks(data)):
                    msg = kvstore_pb2.PutRequest(data=chunk)
                    if first:
                        msg.fingerprint.CopyFrom(fp_msg)
                        first = False
                    if i == 0:
                        msg.header.CopyFrom(header)
                    yield msg

        return await self.stub.Put(messages(), metadata=metadata, timeout=timeout)

    async def stats(self) -> kvstore_pb2.KVStoreStatsResponse:
        return await self.stub.Stats(kvstore_pb2.KVStoreStatsRequest())

    async def watch(self, cursor: int = 0) -> AsyncIterator[kvstore_pb2.PlacementEvent]:
        """Placement events from ``cursor`` on (see the service), until cancelled."""
        async for event in self.stub.WatchPlacements(kvstore_pb2.WatchPlacementsRequest(cursor=cursor)):
            yield event
