"""The Scheduler servicer over loopback with a fake executor: quotas, overload, Release tokens."""

import asyncio

import grpc
import pytest

from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.server import start_scheduler
from tests.support.mesh_harness import wait_for_condition
from tests.support.served_scheduler import served_scheduler


@pytest.fixture
async def scheduler():
    async with served_scheduler(SchedulerConfig(tenant_quotas={"a": 2}, max_queue_len=1, retry_after_s=0.25)) as served:
        yield served


async def _events(stub, **kw):
    return [e async for e in stub.Admit(pb.AdmitRequest(model="m", max_tokens=16, **kw))]


async def test_request_alone_over_quota_is_resource_exhausted_without_retry_delay(scheduler):
    _, stub = scheduler
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _events(stub, request_id="r", tenant="a", num_prompt_tokens=47)  # 3 blocks > 2
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 2" in info.value.details()
    assert "retry-after-s" not in dict(info.value.trailing_metadata())  # waiting never makes it fit


async def test_release_with_completion_tokens_teaches_the_predictor(scheduler):
    svc, stub = scheduler
    events = await _events(stub, request_id="r1", tenant="a", num_prompt_tokens=15)
    lease = events[-1].assignment.lease_id
    assert lease and svc.servicer.core.quotas.snapshot() == {"a": 1}
    await stub.Release(pb.ReleaseRequest(lease_id=lease, num_completion_tokens=12))
    assert svc.servicer.core.quotas.snapshot() == {}
    assert svc.servicer.core.predictor.stats()["mean_abs_error_tokens"] == 4.0  # predicted 16 // 2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Release(pb.ReleaseRequest(lease_id=lease, num_completion_tokens=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Release(pb.ReleaseRequest(lease_id=lease, num_generated_tokens=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "num_generated_tokens must be >= 0, got -1"


async def test_release_with_generated_tokens_alone_teaches_no_prediction(scheduler):
    svc, stub = scheduler
    events = await _events(stub, request_id="r1", tenant="a", num_prompt_tokens=15)
    lease = events[-1].assignment.lease_id
    await stub.Release(pb.ReleaseRequest(lease_id=lease, num_generated_tokens=3))  # the caller left mid-stream
    assert svc.servicer.core.quotas.snapshot() == {}
    assert svc.servicer.core.predictor.stats() == {"num_observed": 0, "num_scored": 0,
                                                   "mean_abs_error_tokens": None}


async def test_higher_priority_arrival_displaces_a_queued_request(scheduler):
    svc, stub = scheduler
    first = await _events(stub, request_id="hold", tenant="x", num_prompt_tokens=63)  # all 4 blocks
    low = asyncio.create_task(_events(stub, request_id="low", tenant="x", num_prompt_tokens=15))
    while len(svc.servicer.core) == 0:
        await asyncio.sleep(0.01)
    high = asyncio.create_task(_events(stub, request_id="high", tenant="x", num_prompt_tokens=15, priority=1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await low
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "displaced" in info.value.details()
    await stub.Release(pb.ReleaseRequest(lease_id=first[-1].assignment.lease_id))
    events = await asyncio.wait_for(high, 60)
    assert events[0].queued.position == 0 and events[-1].assignment.lease_id
    await stub.Release(pb.ReleaseRequest(lease_id=events[-1].assignment.lease_id))


class FakeExecutor:
    """A Connect stream driven by a queue of messages."""

    def __init__(self, stub, executor_id, num_blocks=64, pool=""):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.registered = asyncio.Event()
        self.queue.put_nowait(pb.ExecutorMessage(register=pb.ExecutorRegister(
            executor_id=executor_id, address=f"addr-{executor_id}", model="m", num_blocks=num_blocks, block_size=16,
            max_model_len=4096, pool=pool)))
        self.task = asyncio.create_task(self._run(stub))

    async def _messages(self):
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _run(self, stub):
        async for _ in stub.Connect(self._messages()):
            self.registered.set()

    async def close(self):
        self.queue.put_nowait(None)
        await asyncio.wait_for(self.task, 60)


H = [bytes([i]) * 16 for i in range(4)]


async def _until(predicate, timeout_s: float = 120.0):
    """Polls ``predicate()`` until true; ``timeout_s`` only bounds a hang."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def test_kv_events_route_admissions_and_lease_reports_correct_quotas():
    svc = await start_scheduler(0, config=SchedulerConfig(tenant_quotas={"a": 20}))
    core = svc.servicer.core
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    e0, e1 = FakeExecutor(stub, "e0"), FakeExecutor(stub, "e1")
    try:
        await asyncio.wait_for(asyncio.gather(e0.registered.wait(), e1.registered.wait()), 60)
        e1.queue.put_nowait(pb.ExecutorMessage(kv_events=pb.KvEvents(reset=True, stored=H[:3])))
        await _until(lambda: core.prefix_index.num_blocks("e1") == 3)
        events = await _events(stub, request_id="r", tenant="a", num_prompt_tokens=70, block_hashes=H,
                               hash_block_size=16)  # 4 full blocks; e1 holds the first 3 (48 tokens)
        assert events[-1].assignment.executor_id == "e1"
        lease = events[-1].assignment.lease_id
        assert core.quotas.snapshot() == {"a": 5}  # ceil(71 / 16)
        e1.queue.put_nowait(pb.ExecutorMessage(capacity=pb.CapacityReport(
            num_free_blocks=50, num_running=1, lease_ids=[lease], lease_num_blocks={lease: 9})))
        await _until(lambda: core.quotas.snapshot() == {"a": 9})
        for bad, message in (({"block_hashes": [b"short"], "hash_block_size": 16}, "16 bytes"),
                             ({"block_hashes": H[:1], "hash_block_size": 0}, "hash_block_size"),
                             ({"block_hashes": H, "hash_block_size": 16, "num_prompt_tokens": 20}, "4 block hashes")):
            args = {"request_id": "bad", "tenant": "a", "num_prompt_tokens": 70, **bad}
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _events(stub, **args)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
        await stub.Release(pb.ReleaseRequest(lease_id=lease))
        assert core.quotas.snapshot() == {}
        await e1.close()
        await _until(lambda: core.prefix_index.num_blocks("e1") == 0 and core.registry.get("e1") is None)
        assert core.prefix_index.hit_blocks(H) == {}
    finally:
        await e0.close()
        await channel.close()
        await svc.stop(0.1)


async def test_malformed_kv_events_end_the_stream_with_invalid_argument():
    svc = await start_scheduler(0)
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    e0 = FakeExecutor(stub, "e0")
    try:
        await asyncio.wait_for(e0.registered.wait(), 60)
        e0.queue.put_nowait(pb.ExecutorMessage(kv_events=pb.KvEvents(stored=[b"x" * 15])))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(e0.task, 60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in info.value.details()
        await _until(lambda: svc.servicer.core.registry.get("e0") is None)
    finally:
        await channel.close()
        await svc.stop(0.1)


async def test_the_callers_lease_id_names_the_lease_and_releases_it(scheduler):
    """A gateway that gives up while the Assignment is on its way releases the lease by
    the id its AdmitRequest proposed, without having read it."""
    svc, stub = scheduler
    core = svc.servicer.core
    proposed = "0123456789abcdef0123456789abcdef"
    events = await _events(stub, request_id="r1", tenant="a", num_prompt_tokens=15, lease_id=proposed)
    assert events[-1].assignment.lease_id == proposed
    assert core.num_leases() == 1 and core.quotas.snapshot() == {"a": 1}
    with pytest.raises(grpc.aio.AioRpcError) as info:  # in use: refused, the lease untouched
        await _events(stub, request_id="r2", tenant="a", num_prompt_tokens=15, lease_id=proposed)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details() == f"lease_id {proposed!r} is already in use"
    await stub.Release(pb.ReleaseRequest(lease_id=proposed))
    assert core.num_leases() == 0 and core.quotas.snapshot() == {}
    await stub.Release(pb.ReleaseRequest(lease_id=proposed))  # released twice, or never granted: no error


@pytest.mark.parametrize("lease_id", ["short", "0123456789ABCDEF0123456789ABCDEF", "0123456789abcdef0123456789abcdef0"])
async def test_a_malformed_lease_id_is_invalid_argument(scheduler, lease_id):
    svc, stub = scheduler
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _events(stub, request_id="r", tenant="a", num_prompt_tokens=15, lease_id=lease_id)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "lease_id must be 32 lowercase hex digits (a uuid4's hex) or empty"
    assert svc.servicer.core.num_leases() == 0 and len(svc.servicer.core) == 0


async def test_a_release_of_a_queued_requests_proposed_id_withdraws_it():
    """A gateway's Release of its proposed lease id can reach the scheduler before its
    cancelled Admit does; granted then, the assignment could be written to the stream
    before the cancel arrives and the lease would wait for its expiry. The Release
    withdraws the queued request instead: its Admit ends CANCELLED, nothing is granted
    when the blocks free up, and nothing is left queued or leased."""
    import uuid

    async with served_scheduler(SchedulerConfig(), num_blocks=1) as (svc, stub):
        core = svc.servicer.core
        hold = await _events(stub, request_id="hold", tenant="a", num_prompt_tokens=15)
        proposed = uuid.uuid4().hex
        call = stub.Admit(pb.AdmitRequest(model="m", max_tokens=16, request_id="x", tenant="a",
                                          num_prompt_tokens=15, lease_id=proposed))
        await call.read()  # queued behind hold
        assert len(core) == 1 and core.lease_id_in_use(proposed)
        await stub.Release(pb.ReleaseRequest(lease_id=proposed))
        assert len(core) == 0 and not core.lease_id_in_use(proposed)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert info.value.details() == "the caller released its lease id before it was granted"
        await stub.Release(pb.ReleaseRequest(lease_id=hold[-1].assignment.lease_id))
        assert core.num_leases() == 0 and len(core) == 0 and core.quotas.snapshot() == {}


@pytest.mark.parametrize("order", ["cancel-release-grant", "release-cancel-grant", "grant-cancel-release"])
async def test_a_release_of_the_proposed_id_racing_the_grant_strands_nothing(order):
    """The caller's Release of its proposed id can reach the scheduler before the grant
    (a no-op), the grant can follow before the Admit handler sees its cancellation."""
    import uuid

    async with served_scheduler(SchedulerConfig(), num_blocks=1) as (svc, stub):
        core = svc.servicer.core
        for i in range(40):
            hold = await _events(stub, request_id=f"hold{i}", tenant="a", num_prompt_tokens=15)
            proposed = uuid.uuid4().hex
            call = stub.Admit(pb.AdmitRequest(model="m", max_tokens=16, request_id=f"x{i}", tenant="a",
                                              num_prompt_tokens=15, lease_id=proposed))
            await call.read()  # queued behind hold
            assert len(core) == 1
            free = pb.ReleaseRequest(lease_id=hold[-1].assignment.lease_id)
            mine = pb.ReleaseRequest(lease_id=proposed)
            if order == "cancel-release-grant":
                call.cancel()
                await asyncio.gather(stub.Release(mine), stub.Release(free))
            elif order == "release-cancel-grant":
                r = asyncio.ensure_future(stub.Release(mine))
                call.cancel()
                await asyncio.gather(r, stub.Release(free))
            else:
                f = asyncio.ensure_future(stub.Release(free))
                call.cancel()
                await asyncio.gather(f, stub.Release(mine))
            # the Admit handler sees its cancellation when the server's loop gets to it: waited
            # for (the bound only ends a hang; 0.5 s was too short for a loaded host)
            await wait_for_condition(lambda: core.num_leases() == 0 and len(core) == 0, 60,
                                     f"round {i}: nothing stranded")
