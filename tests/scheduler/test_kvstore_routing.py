"""The scheduler follows the kvstore's placements and credits its blocks when routing:
the index's snapshot/delta semantics, the cost function's exact values, placement,
and the follower against a real kvstore service (restart included)."""

from __future__ import annotations

import asyncio

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_to_bytes
from meshserve.kvstore_client import KVStoreClient
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.kvstore_index import KVStoreIndex, MOVED, REMOVED, SNAPSHOT_END, STORED
from scheduler.registry import ExecutorState
from scheduler.routing import Candidate, RoutingConfig, score
from scheduler.server import start_scheduler

NS, OTHER = b"n" * 16, b"o" * 16
H = [hash_to_bytes(i) for i in range(1, 9)]
FP = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 2, 2, 64, "float32"))


def test_index_snapshot_then_deltas():
    idx = KVStoreIndex()
    idx.apply(3, STORED, NS, H[0], True)
    idx.apply(3, STORED, NS, H[1], True)
    assert idx.hit_blocks(NS, H) == 0  # a snapshot counts only once it ends
    idx.apply(3, SNAPSHOT_END, b"", b"", True)
    assert (idx.hit_blocks(NS, H), idx.hit_blocks(OTHER, H), idx.cursor) == (2, 0, 3)
    idx.apply(4, STORED, NS, H[3], False)  # not leading: H[2] is missing
    idx.apply(5, MOVED, NS, H[2], False)
    assert idx.hit_blocks(NS, H) == 4
    idx.apply(6, REMOVED, NS, H[1], False)
    assert (idx.hit_blocks(NS, H), idx.num_blocks(NS), idx.cursor) == (1, 3, 6)
    idx.apply(7, STORED, OTHER, H[0], True)  # a new snapshot replaces everything at its end
    idx.apply(7, SNAPSHOT_END, b"", b"", True)
    assert (idx.hit_blocks(NS, H), idx.hit_blocks(OTHER, H), idx.num_blocks()) == (0, 1, 1)
    idx.clear()
    assert (idx.num_blocks(), idx.cursor) == (0, 0)


def test_cost_credits_kvstore_tokens_at_their_fetch_cost():
    cfg = RoutingConfig(kvstore_token_cost=0.1)
    cands = [Candidate("local", hit_tokens=64, load_tokens=200.0, available_blocks=10),
             Candidate("remote", hit_tokens=0, load_tokens=0.0, available_blocks=10, kvstore_hit_tokens=96),
             Candidate("cold", hit_tokens=0, load_tokens=0.0, available_blocks=10)]
    got = {s.executor_id: (s.cost, s.credited_hit_tokens, s.credited_fetch_tokens) for s in score(cands, 100, cfg)}
    # local: 100 - 64 + 200; remote: 100 - 0.9 × 96; cold: 100
    assert got == {"local": (236.0, 64, 0), "remote": (100 - 0.9 * 96, 0, 96), "cold": (100.0, 0, 0)}
    assert [s.executor_id for s in score(cands, 100, cfg)] == ["remote", "cold", "local"]
    both = Candidate("both", hit_tokens=32, load_tokens=0.0, available_blocks=10, kvstore_hit_tokens=200)
    (s,) = score([both], 100, cfg)  # fetch credit: up to prompt - 1 = 99, beyond the local 32
    assert (s.credited_hit_tokens, s.credited_fetch_tokens, s.cost) == (32, 67, 100 - 32 - 0.9 * 67)
    (s,) = score([both], 100, RoutingConfig("least-loaded"))
    assert (s.credited_hit_tokens, s.credited_fetch_tokens, s.cost) == (0, 0, 100.0)


def _core_with(kvstore_blocks: int) -> AdmissionCore:
    core = AdmissionCore(SchedulerConfig())
    core.registry.add(ExecutorState("e0", "a0", "m", 64, 16, 4096))
    core.registry.add(ExecutorState("e1", "a1", "m", 64, 16, 4096, kvstore_namespace=NS))
    for i in range(kvstore_blocks):
        core.kvstore_index.apply(i + 1, STORED, NS, H[i], False)
    return core


def test_placement_prefers_an_executor_that_can_fetch_the_prefix():
    def place(core, rid):
        core.submit(AdmissionRequest(rid, "t", 0, 8 * 16 + 5, 8, "m", block_hashes=tuple(H), hash_block_size=16))
        [(_, lease)] = core.dispatch()
        return lease.executor_id

    core = _core_with(0)
    core.prefix_index.stored("e0", H[:2])  # e0 holds 2 blocks locally, the kvstore nothing
    assert place(core, "a") == "e0"
    core = _core_with(8)  # the kvstore holds all 8 blocks in e1's namespace
    core.prefix_index.stored("e0", H[:2])
    assert place(core, "b") == "e1"
    core = _core_with(8)
    core.registry.get("e1").block_size = 32  # hashed in 16-token blocks: no credit for a 32-token executor
    core.prefix_index.stored("e0", H[:2])
    assert place(core, "c") == "e0"


async def test_follower_tracks_a_real_kvstore_and_its_restart():
    store = KVStore(memory_bytes=64 * FP.block_bytes)
    kv = await start_kvstore(store, 0)
    port = kv.port
    client = KVStoreClient(kv.address)
    await client.put(FP, [(1, bytes(FP.block_bytes)), (2, bytes(FP.block_bytes))])
    sched = await start_scheduler(0, kvstore_address=kv.address)
    index = sched.servicer.core.kvstore_index

    async def until(pred, timeout_s: float = 120.0):  # the bound only stops a hang
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not pred():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    try:
        hashes = [hash_to_bytes(h) for h in (1, 2, 3)]
        assert await until(lambda: index.hit_blocks(FP.namespace, hashes) == 2)  # the snapshot
        await client.put(FP, [(3, bytes(FP.block_bytes))])
        assert await until(lambda: index.hit_blocks(FP.namespace, hashes) == 3)  # a delta
        await client.close()
        await kv.stop(0)
        assert await until(lambda: index.num_blocks() == 0)  # unreachable: nothing can be fetched
        kv = await start_kvstore(KVStore(memory_bytes=64 * FP.block_bytes), port)  # restarted, empty
        client = KVStoreClient(kv.address)
        await client.put(FP, [(1, bytes(FP.block_bytes))])
        assert await until(lambda: index.hit_blocks(FP.namespace, hashes) == 1)
        assert index.num_blocks() == 1
    finally:
        await client.close()
        await sched.stop(0)
        await kv.stop(0)
