"""The KVStore service over loopback: streaming Put/Get in chunks, validation with
clear status codes, leases tied to the Get stream, stats and placement events."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_to_bytes
from meshserve.kvstore_client import KVStoreClient
from meshserve.kvstore_payload import CHUNK_BYTES
from meshserve.kvstore_wire import fingerprint_to_proto
from meshserve.v1 import kvstore_pb2

FP = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 2, 2, 64, "float32"))  # 16 KiB blocks
BIG = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 40, 4, 64, "float32"))  # 1.25 MiB: 2 chunks


def payload(i: int, fp: KVStoreFingerprint = FP) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(256)]) * (fp.block_bytes // 256)


@pytest.fixture
async def served():
    store = KVStore(memory_bytes=8 * BIG.block_bytes)
    service = await start_kvstore(store, 0)
    client = KVStoreClient(service.address)
    yield store, client
    await client.close()
    await service.stop(0)


async def test_put_then_get_roundtrip_in_chunks(served):
    store, client = served
    assert BIG.block_bytes > CHUNK_BYTES
    resp = await client.put(BIG, [(11, payload(1, BIG)), (12, payload(2, BIG))])
    assert (resp.num_stored, resp.num_existing, resp.num_no_space) == (2, 0, 0)
    resp = await client.put(BIG, [(11, payload(1, BIG))])
    assert (resp.num_stored, resp.num_existing) == (0, 1)
    got = await client.get(BIG, [11, 12, 13], lease_owner="req-1")
    assert got.payloads == [payload(1, BIG), payload(2, BIG)]
    assert (got.num_found, got.num_corrupt, got.num_bytes) == (2, 0, 2 * BIG.block_bytes)
    assert await client.lookup(BIG, [11, 12, 13]) == 2
    assert await client.lookup(FP, [11]) == 0  # another layout is another namespace
    s = await client.stats()
    assert (s.blocks_stored, s.bytes_in, s.bytes_out, s.num_leases) == (2, 2 * BIG.block_bytes,
                                                                         2 * BIG.block_bytes, 0)
    store.check_integrity()


async def test_bad_input_is_invalid_argument(served):
    _, client = served
    bad_fp = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 2, 2, 64, "float32"))
    req = kvstore_pb2.LookupRequest(block_hashes=[hash_to_bytes(1)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Lookup(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_id" in err.value.details()
    req.fingerprint.CopyFrom(kvstore_pb2.KVFingerprint(model_id="m", dtype="fp8", block_size=16, num_layers=1,
                                                       num_kv_heads=1, head_dim=8))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Lookup(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.put(bad_fp, [(1, b"x" * 100)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_bytes 100" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Lookup(kvstore_pb2.LookupRequest(fingerprint=kvstore_pb2.KVFingerprint(
            model_id="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64),
            block_hashes=[b"short"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in err.value.details()


async def test_a_torn_put_stores_nothing(served):
    store, client = served
    header = kvstore_pb2.BlockHeader(block_hash=hash_to_bytes(5), num_bytes=FP.block_bytes, checksum=0)
    first = kvstore_pb2.PutRequest(data=payload(5)[:1000])
    first.fingerprint.CopyFrom(fingerprint_to_proto(FP))
    first.header.CopyFrom(header)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Put(iter([first]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not stored" in err.value.details()
    assert store.lookup(FP.namespace, [5]) == 0


async def test_get_leases_are_released_when_the_stream_is_cancelled(served):
    store, client = served
    await client.put(BIG, [(h, payload(h, BIG)) for h in range(8)])
    call = client.stub.Get(kvstore_pb2.GetRequest(fingerprint=fingerprint_to_proto(BIG),
                                                  block_hashes=[hash_to_bytes(h) for h in range(8)],
                                                  lease_owner="req-9"))
    first = await call.read()
    assert first.num_blocks == 8
    await call.read()  # the first chunk of 10 MiB: the stream is mid-transfer
    s = await client.stats()
    assert (s.num_leases, s.num_lease_owners) == (8, 1)
    call.cancel()
    deadline = asyncio.get_running_loop().time() + 120  # only bounds a hang
    while (await client.stats()).num_leases != 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    s = await client.stats()
    assert (s.num_leases, s.num_lease_owners) == (0, 0)
    store.check_integrity()


async def test_watch_placements_on_an_empty_store_sends_one_snapshot_end_then_waits(served):
    """An empty store's cursor is 0, which also means "no snapshot yet": the stream
    sent snapshot markers back to back, without end, until the first block was stored
    (each kvstore start, for every scheduler following it)."""
    _, client = served
    events: asyncio.Queue = asyncio.Queue()

    async def follow():
        async for e in client.watch(0):
            events.put_nowait(e)

    task = asyncio.create_task(follow())
    first = await asyncio.wait_for(events.get(), 60)
    await asyncio.sleep(0.5)
    assert ((first.seq, first.kind, first.snapshot), events.qsize()) == (
        (0, kvstore_pb2.PLACEMENT_KIND_SNAPSHOT_END, True), 0)
    await client.put(FP, [(1, payload(1))])
    e = await asyncio.wait_for(events.get(), 60)
    assert (e.seq, e.kind, e.block_hash, e.snapshot) == (1, kvstore_pb2.PLACEMENT_KIND_STORED, hash_to_bytes(1),
                                                          False)
    task.cancel()


async def test_watch_placements_snapshot_then_deltas(served):
    _, client = served
    await client.put(FP, [(1, payload(1)), (2, payload(2))])
    events: asyncio.Queue = asyncio.Queue()

    async def follow(cursor):
        async for e in client.watch(cursor):
            events.put_nowait(e)

    task = asyncio.create_task(follow(0))
    got = [await asyncio.wait_for(events.get(), 60) for _ in range(3)]
    assert [(e.seq, e.kind, e.block_hash, e.snapshot) for e in got] == [
        (2, kvstore_pb2.PLACEMENT_KIND_STORED, hash_to_bytes(1), True),
        (2, kvstore_pb2.PLACEMENT_KIND_STORED, hash_to_bytes(2), True),
        (2, kvstore_pb2.PLACEMENT_KIND_SNAPSHOT_END, b"", True)]
    await client.put(FP, [(3, payload(3))])
    e = await asyncio.wait_for(events.get(), 60)
    assert (e.seq, e.kind, e.block_hash, e.tier, e.snapshot) == (3, kvstore_pb2.PLACEMENT_KIND_STORED,
                                                                  hash_to_bytes(3), "memory", False)
    assert e.namespace == FP.namespace
    task.cancel()
    resumed = []
    async for e in client.watch(2):  # a cursor still in the log: deltas only
        resumed.append((e.seq, e.block_hash, e.snapshot))
        break
    assert resumed == [(3, hash_to_bytes(3), False)]
