"""The Scheduler servicer's trust boundary over loopback: signed leases (checked with the
key of the executor's RegisterAck), forged tenants, rate limits, per-tenant request ids,
RenewLease, the request id limit."""

import asyncio
import contextlib

import grpc
import pytest

from meshserve.lease_token import LeaseVerifier
from meshserve.request_ids import MAX_REQUEST_ID_LEN
from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.server import start_scheduler
from scheduler.tenant_limits import TenantLimits

LIMITS = {"acme": TenantLimits(max_priority=3), "globex": TenantLimits(requests_per_s=1.0)}


@contextlib.asynccontextmanager
async def scheduler_with_executor(config: SchedulerConfig):
    """A scheduler and one fake executor "e0" (64 blocks): yields (service, stub, the ack).
    Its clock is held still: no rate-limit bucket refills during a test, however slowly
    a loaded host runs it."""
    svc = await start_scheduler(0, config=config, clock=lambda: 1000.0)
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    stop, acked = asyncio.Event(), asyncio.get_running_loop().create_future()

    async def messages():
        yield pb.ExecutorMessage(register=pb.ExecutorRegister(executor_id="e0", address="127.0.0.1:1", model="m",
                                                              num_blocks=64, block_size=16, max_model_len=4096))
        await stop.wait()

    async def run():
        async for cmd in stub.Connect(messages()):
            acked.set_result(cmd.registered)

    task = asyncio.create_task(run())
    ack = await asyncio.wait_for(acked, 60)
    try:
        yield svc, stub, ack
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await channel.close()
        await svc.stop(0.1)


async def admit(stub, **kw):
    events = [e async for e in stub.Admit(pb.AdmitRequest(model="m", max_tokens=16, num_prompt_tokens=15, **kw))]
    return events[-1].assignment


async def test_assignment_carries_a_lease_the_executor_verifies_with_the_registered_key():
    async with scheduler_with_executor(SchedulerConfig(tenant_limits=LIMITS, lease_ttl_s=7.0)) as (svc, stub, ack):
        assert len(ack.lease_public_key) == 32
        a = await admit(stub, request_id="r1", tenant="acme", priority=2**31 - 1)
        verifier = LeaseVerifier("e0")
        verifier.set_public_key(ack.lease_public_key)
        claims = verifier.verify(a.lease, "r1", "acme")
        assert (claims.lease_id, claims.executor_id, claims.num_blocks, claims.priority) == (a.lease_id, "e0", 1, 3)
        assert a.lease_ttl_s == 7.0
        renewed = await stub.RenewLease(pb.RenewLeaseRequest(lease_id=a.lease_id))
        assert renewed.expires_in_s == 7.0
        await stub.Release(pb.ReleaseRequest(lease_id=a.lease_id))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RenewLease(pb.RenewLeaseRequest(lease_id=a.lease_id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_forged_tenant_is_not_admitted_and_holds_nothing():
    async with scheduler_with_executor(SchedulerConfig(tenant_limits=LIMITS)) as (svc, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admit(stub, request_id="r1", tenant="initech")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "unknown tenant 'initech'" in info.value.details()
        assert svc.servicer.core.num_leases() == 0 and svc.servicer.core.quotas.snapshot() == {}


async def test_rate_limited_tenant_gets_resource_exhausted_with_retry_delay_other_tenant_served():
    async with scheduler_with_executor(SchedulerConfig(tenant_limits=LIMITS)) as (svc, stub, _):
        await admit(stub, request_id="g1", tenant="globex")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admit(stub, request_id="g2", tenant="globex")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests/s" in info.value.details()
        delay = float(dict(info.value.trailing_metadata())["retry-after-s"])
        assert delay == 1.0  # an empty bucket of 1 request/s
        for i in range(5):
            assert (await admit(stub, request_id=f"a{i}", tenant="acme")).lease_id


async def test_request_ids_are_scoped_per_tenant():
    async with scheduler_with_executor(SchedulerConfig(tenant_limits=LIMITS)) as (svc, stub, _):
        a = await admit(stub, request_id="same", tenant="acme")
        g = await admit(stub, request_id="same", tenant="globex")  # no collision, nothing learnt
        assert a.lease_id != g.lease_id
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admit(stub, request_id="same", tenant="acme")
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert info.value.details() == "request_id 'same' is already queued or running"


async def test_request_id_over_the_length_limit_is_invalid_argument():
    async with scheduler_with_executor(SchedulerConfig(tenant_limits=LIMITS)) as (svc, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admit(stub, request_id="x" * (MAX_REQUEST_ID_LEN + 1), tenant="acme")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the limit is {MAX_REQUEST_ID_LEN}" in info.value.details()
