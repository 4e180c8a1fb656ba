"""Mutual TLS and role checks over real TLS on loopback (no model): who may connect
to the scheduler and the kvstore, with which certificate, and what each role may call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_to_bytes
from meshserve.grpc_server import open_channel
from meshserve.kvstore_client import KVStoreClient
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.server import start_scheduler
from tests.support.mesh_harness import wait_for_condition
from tests.support.tls import cert_dir, role_tls

FP = KVStoreFingerprint(ModelFingerprint("m", "r1"), KVLayout(16, 2, 2, 64, "float32"))  # 16 KiB blocks
NO_CERT = "no-cert"  # TLS that trusts the mesh's CA but presents no client certificate
CALLERS = {
    "plaintext": lambda: PLAINTEXT,
    NO_CERT: lambda: TLSConfig(ca=str(cert_dir() / "ca.pem")),
    "foreign-ca": lambda: role_tls("executor", "foreign"),  # the right role, signed by another CA
}


def register(executor_id: str = "rogue") -> pb.ExecutorMessage:
    return pb.ExecutorMessage(register=pb.ExecutorRegister(
        executor_id=executor_id, address="127.0.0.1:1", model="m", num_blocks=100_000, block_size=16,
        max_model_len=4096))


async def refused_connect(address: str, tls: TLSConfig) -> tuple[grpc.StatusCode, str]:
    """The status and details with which the scheduler refuses ``Scheduler.Connect`` (an
    executor's registration stream) over ``tls``; fails the test if it is not refused in 10 s.

    The role check refuses the call before its first message is read, so nothing is written:
    a registration written while the refusal is on its way, failing first, makes grpc.aio end
    the call INTERNAL itself ("Failed execute_batch: SendMessageOperation") in place of the
    server's status."""
    async with open_channel(address, tls) as ch:
        call = scheduler_pb2_grpc.SchedulerStub(ch).Connect(timeout=30)
        try:
            code = await asyncio.wait_for(call.code(), 10)
        except TimeoutError:
            pytest.fail("Scheduler.Connect was not refused")
        return code, await call.details()


@pytest.fixture
async def scheduler():
    svc = await start_scheduler(0, tls=role_tls("scheduler"))
    yield svc
    await svc.stop(0)


@pytest.fixture
async def kvstore():
    store = KVStore(memory_bytes=64 * FP.block_bytes)
    svc = await start_kvstore(store, 0, tls=role_tls("kvstore"))
    yield store, svc
    await svc.stop(0)


@pytest.mark.parametrize("caller", sorted(CALLERS))
async def test_a_rogue_executor_without_a_valid_certificate_cannot_connect(scheduler, caller):
    """Case C35: plaintext, TLS without a client certificate and a certificate of
    another CA fail the handshake (UNAVAILABLE); no handler runs, nothing registers."""
    code, _ = await refused_connect(scheduler.address, CALLERS[caller]())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert list(scheduler.servicer.core.registry) == []


@pytest.mark.parametrize("role", ["gateway", "client", "kvstore", "scheduler"])
async def test_a_certificate_of_another_role_cannot_register_as_an_executor(scheduler, role):
    """Case C35: a gateway-role (or any non-executor) certificate calling
    Scheduler.Connect gets PERMISSION_DENIED; nothing registers."""
    code, details = await refused_connect(scheduler.address, role_tls(role))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == f"role {role} may not call /meshserve.v1.Scheduler/Connect (allowed: executor)"
    assert list(scheduler.servicer.core.registry) == []


async def test_an_executor_certificate_registers(scheduler):
    """The executor role may connect: the registration is acknowledged."""
    done = asyncio.Event()

    async def messages():  # the stream stays open (a closed one deregisters) until the check
        yield register("e1")
        await done.wait()

    async with open_channel(scheduler.address, role_tls("executor")) as ch:
        call = scheduler_pb2_grpc.SchedulerStub(ch).Connect(messages())
        first = await call.read()
        assert first.registered.executor_id == "e1"
        assert [e.executor_id for e in scheduler.servicer.core.registry] == ["e1"]
        done.set()
        call.cancel()


async def test_an_executor_certificate_cannot_admit(scheduler):
    """Case C35: an executor-role certificate calling Scheduler.Admit (or Release)
    gets PERMISSION_DENIED."""
    async with open_channel(scheduler.address, role_tls("executor")) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [e async for e in stub.Admit(pb.AdmitRequest(request_id="r", tenant="t", num_prompt_tokens=4,
                                                              max_tokens=4))]
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(pb.ReleaseRequest(lease_id="x"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert scheduler.servicer.core.num_leases() == 0


@pytest.mark.parametrize("caller", sorted(CALLERS))
async def test_a_client_without_a_valid_certificate_cannot_read_or_write_the_kvstore(kvstore, caller):
    """Case C35: plaintext, no client certificate, another CA: Put, Get and Lookup
    fail (UNAVAILABLE) and the store is unchanged."""
    store, svc = kvstore
    client = KVStoreClient(svc.address, CALLERS[caller]())
    try:
        for call in (client.put(FP, [(1, bytes(FP.block_bytes))]), client.get(FP, [1]), client.lookup(FP, [1])):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
    assert (store.stats().blocks_stored, store.stats().bytes_in, store.stats().bytes_out) == (0, 0, 0)


@pytest.mark.parametrize("role", ["gateway", "client", "scheduler"])
async def test_only_executors_read_and_write_kvstore_blocks(kvstore, role):
    """Case C35: a gateway-, client- or scheduler-role certificate calling
    KVStore.Put, Get or Lookup gets PERMISSION_DENIED; the store is unchanged. An
    executor's Put then Get of the same block succeeds."""
    store, svc = kvstore
    block = bytes(range(256)) * (FP.block_bytes // 256)
    client = KVStoreClient(svc.address, role_tls(role))
    try:
        for call in (client.put(FP, [(1, block)]), client.get(FP, [1]), client.lookup(FP, [1])):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await client.close()
    assert store.stats().blocks_stored == 0
    executor = KVStoreClient(svc.address, role_tls("executor"))
    try:
        assert (await executor.put(FP, [(1, block)])).num_stored == 1
        assert (await executor.get(FP, [1])).payloads == [block]
    finally:
        await executor.close()
    assert store.stats().blocks_stored == 1


async def test_the_scheduler_follows_kvstore_placements_over_mutual_tls(kvstore):
    """The scheduler role may WatchPlacements: its follower connects and indexes a
    block an executor stored; an executor may not watch."""
    store, kv = kvstore
    sched = await start_scheduler(0, kvstore_address=kv.address, tls=role_tls("scheduler"))
    executor = KVStoreClient(kv.address, role_tls("executor"))
    try:
        await wait_for_condition(sched.kvstore_follower.connected.is_set, 60, "the follower to connect")
        await executor.put(FP, [(7, bytes(FP.block_bytes))])
        index = sched.servicer.core.kvstore_index
        await wait_for_condition(lambda: index.hit_blocks(FP.namespace, [hash_to_bytes(7)]) == 1, 60,
                                 "the block indexed")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [e async for e in executor.watch(0)]
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await executor.close()
        await sched.stop(0)
