"""A Put never makes the kvstore buffer beyond its memory budget: a block larger than
the memory tier is refused before its bytes are taken, and blocks in flight over all
Put calls together stay within the budget."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_to_bytes
from meshserve.kvstore_client import KVStoreClient
from meshserve.kvstore_payload import checksum
from meshserve.kvstore_wire import fingerprint_to_proto
from meshserve.v1 import kvstore_pb2

FP = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 2, 2, 64, "float32"))  # 16 KiB blocks
# a header claiming a 2.46 GB block (the attack): its layout is self-consistent
HUGE = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 24000, 10, 80, "float32"))


@pytest.fixture
async def served():
    store = KVStore(memory_bytes=4 * FP.block_bytes)
    service = await start_kvstore(store, 0)
    client = KVStoreClient(service.address)
    yield store, service, client
    await client.close()
    await service.stop(0)


def header_message(fp: KVStoreFingerprint, block_hash: int, data: bytes = b"") -> kvstore_pb2.PutRequest:
    return kvstore_pb2.PutRequest(fingerprint=fingerprint_to_proto(fp), data=data, header=kvstore_pb2.BlockHeader(
        block_hash=hash_to_bytes(block_hash), num_bytes=fp.block_bytes, checksum=checksum(data)))


async def test_a_block_larger_than_the_memory_budget_is_refused_with_memory_unchanged(served):
    store, service, client = served
    assert HUGE.block_bytes == 2_457_600_000
    before = store.stats()

    async def messages():
        yield header_message(HUGE, 1, b"\x00" * 1024)
        yield kvstore_pb2.PutRequest(data=b"\x00" * (1 << 20))

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Put(messages())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"block of {HUGE.block_bytes} bytes exceeds the kvstore's memory budget of {4 * FP.block_bytes}" \
        in err.value.details()
    assert dataclasses.asdict(store.stats()) == dataclasses.asdict(before)
    assert service.servicer.buffered_bytes == 0


async def test_blocks_in_flight_over_all_puts_stay_within_the_budget(served):
    store, service, client = served
    release = asyncio.Event()
    calls = []
    for i in range(4):  # four Puts each hold half of a 16 KiB block: the whole 64 KiB budget reserved
        async def messages(i=i):
            yield header_message(FP, i, b"\x01" * (FP.block_bytes // 2))
            await release.wait()
        calls.append(client.stub.Put(messages()))
    tasks = [asyncio.ensure_future(c) for c in calls]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while service.servicer.buffered_bytes < 4 * FP.block_bytes:
        assert loop.time() < deadline, "the four Puts never reached the server"
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.put(FP, [(9, b"\x02" * FP.block_bytes)])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-s", "1.000") in tuple(err.value.trailing_metadata())
    release.set()  # the four end without their second half: refused, their reservations returned
    for t in tasks:
        with pytest.raises(grpc.aio.AioRpcError):
            await t
    assert service.servicer.buffered_bytes == 0 and store.stats().memory_used_bytes == 0
    resp = await client.put(FP, [(9, b"\x02" * FP.block_bytes)])
    assert resp.num_stored == 1
