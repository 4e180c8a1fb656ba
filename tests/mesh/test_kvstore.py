"""The kvstore in the mesh: case C19 (late kvstore completions after an
abort), the executor's kvstore counters over its Stats RPC, and the kvstore spans
in the request's trace."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.block_hash import routing_block_hashes
from meshserve.client import build_request, channel, generate
from meshserve.kvstore_client import KVStoreClient
from meshserve.telemetry import memory_exporter, outgoing_metadata
from meshserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.support.engines import make_engine
from tests.support.leases import signed_lease
from tests.support.mesh_harness import start_local_mesh
from tests.support.served_kvstore import STALL_S, DelayingServicer
from tests.support.tls import role_tls

pytestmark = pytest.mark.model

PROMPT_LEN = 2000
BLOCKS = (PROMPT_LEN - 1) // 16   # 124 full blocks a second executor can fetch


def execute_request(mesh, executor: int, request_id: str, prompt: list[int],
                    max_tokens: int) -> executor_pb2.ExecuteRequest:
    req = executor_pb2.ExecuteRequest(request_id=request_id, prompt_token_ids=prompt, tenant="default",
                                      lease=signed_lease(mesh, executor, request_id))
    req.sampling.CopyFrom(common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return req


async def wait_for(predicate, timeout_s: float = 120.0, what: str = "condition") -> None:
    """Polls the async ``predicate`` until true; ``timeout_s`` only bounds a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def test_late_kvstore_completions_after_an_abort_are_ignored(tokenizer):
    """Case C19: a request cancelled right after its first token while its block
    writes wait for their acknowledgements, and one cancelled while loading from
    the kvstore: late completions are ignored, leases drop to 0, every written block
    is whole; the canary passes and a later request loads the prefix."""
    store = KVStore(memory_bytes=512 << 20)
    acks = asyncio.Event()
    DelayingServicer.put_ack_gate = acks            # Put acknowledgements wait until after the cancel...
    DelayingServicer.put_ack_delay_s = 0.2          # ...and then come 200 ms late
    kv_service = await start_kvstore(store, 0, servicer_cls=DelayingServicer, tls=role_tls("kvstore"))
    engines = [make_engine(max_model_len=4096, num_blocks=300, max_num_batched_tokens=2048) for _ in range(2)]
    # fetches are cancelled by the test, never given up on by a deadline of the machine's speed
    m = await start_local_mesh(engines, tokenizer, kvstore=kv_service, kvstore_fetch_timeout_s=STALL_S)
    kv = KVStoreClient(kv_service.address, m.tls("client"))  # Stats only: the client role may
    prompt = [1000 + (i * 7919) % 40000 for i in range(PROMPT_LEN)]
    try:
        # 1. executor 0 computes the prompt, publishes its 125 blocks; cancel right after the first token
        async with channel(m.executors[0][0].address, m.tls("gateway")) as ch:
            call = executor_pb2_grpc.ExecutorStub(ch).Execute(execute_request(m, 0, "c19-save", prompt, 64))
            first = await call.read()
            assert len(first.token_ids) == 1 and first.num_kvstore_tokens == 0
            call.cancel()
        conn0 = engines[0].kv_connector
        assert conn0._publishes, "block writes should still be in flight at the cancel"
        acks.set()
        await asyncio.to_thread(conn0.flush)
        stats = await kv.stats()
        assert stats.blocks_stored == PROMPT_LEN // 16 and stats.num_leases == 0
        store.check_integrity()
        for ns, block_hash in store.lru_order():       # every written block is whole and valid
            data, crc = store.read(ns, block_hash)
            assert len(data) == engines[0].kv_store_fingerprint.block_bytes
        assert store.stats().corrupt_blocks == 0
        # the scheduler follows the placements: the gateway's chain hashes of the prompt finds
        # every published block under executor 1's namespace (the same model and layout)
        hashes = routing_block_hashes(prompt, 16, engines[0].model_id, engines[0].revision,
                                      cache_salt="default")  # the tenant of its leases (--prefix-cache-scope tenant)
        index = m.scheduler.servicer.core.kvstore_index

        async def indexed():
            return index.hit_blocks(engines[1].kv_store_fingerprint.namespace, hashes) == PROMPT_LEN // 16
        await wait_for(indexed, what="the scheduler to index the published blocks")

        # 2. executor 1 starts fetching those blocks (the load stalls after its first message); cancel
        # during the load
        DelayingServicer.get_delay_s = STALL_S
        memory_exporter().clear()
        async with channel(m.executors[1][0].address, m.tls("gateway")) as ch:
            call = executor_pb2_grpc.ExecutorStub(ch).Execute(execute_request(m, 1, "c19-load", prompt, 8),
                                                              metadata=outgoing_metadata())
            reader = asyncio.create_task(call.read())

            async def leased():
                return (await kv.stats()).num_leases == BLOCKS
            await wait_for(leased, what="the fetch to lease its blocks")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader

        async def released():
            return (await kv.stats()).num_leases == 0 and (await kv.stats()).num_lease_owners == 0
        await wait_for(released, what="leases of the aborted request to drop to 0")
        DelayingServicer.get_delay_s = 0.0
        await m.wait_idle()
        assert engines[1].kv_connector._fetches == {}
        assert engines[1].stats().kvstore_hit_tokens == 0   # it never got to load anything
        spans = {s.name: s for s in memory_exporter().get_finished_spans()}
        assert spans["kvstore.get"].context.trace_id == spans["executor.kvstore_fetch"].context.trace_id \
            == spans["executor.execute"].context.trace_id

        # 3. the canary passes, and a fresh request on executor 1 now loads the prefix
        out = await generate(m.stub, build_request(chat=[("user", "Hi")], max_tokens=4, temperature=0))
        assert len(out.token_ids) == 4
        async with channel(m.executors[1][0].address, m.tls("gateway")) as ch:
            msgs = [msg async for msg in executor_pb2_grpc.ExecutorStub(ch).Execute(
                execute_request(m, 1, "c19-after", prompt, 4))]
        assert msgs[0].num_kvstore_tokens == msgs[0].num_cached_tokens == BLOCKS * 16
        s1 = await m.executor_stats(1)
        assert (s1.kvstore_hit_tokens, s1.kvstore_fetched_blocks, s1.kvstore_corrupt_blocks) == (BLOCKS * 16,
                                                                                                BLOCKS, 0)
        assert s1.kvstore_fetches >= 1 and s1.kvstore_fetch_seconds > 0
        await m.wait_idle()
        for engine in engines:
            engine.check_integrity()
            assert engine.stats().num_free_blocks == engine.num_blocks
        assert all(e[1].failure is None for e in m.executors)
        assert (await kv.stats()).num_leases == 0
    finally:
        DelayingServicer.put_ack_delay_s = DelayingServicer.get_delay_s = 0.0
        DelayingServicer.put_ack_gate = None
        await kv.close()
        await m.stop()


async def test_kvstore_bad_requests_are_invalid_argument_not_internal():
    service = await start_kvstore(KVStore(memory_bytes=1 << 20), 0)
    try:
        async with channel(service.address) as ch:
            from meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Put(iter([kvstore_pb2.PutRequest(data=b"x")]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fingerprint" in err.value.details()
    finally:
        await service.stop(0)
