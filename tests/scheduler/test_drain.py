"""Draining over the Scheduler servicer with fake executors (no model): nothing new is
routed to a draining executor, and it is told it may leave only once no lease of it
remains (C42); the planner's metrics are exported."""

import asyncio

import grpc
from prometheus_client import generate_latest

from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.planner import PlannerConfig
from scheduler.server import start_scheduler
from tests.support.mesh_harness import wait_for_condition


class RecordingExecutor:
    """A Connect stream driven by a queue of messages; records the scheduler's commands."""

    def __init__(self, stub, executor_id: str, startup_s: float = 0.0):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.commands: list[pb.SchedulerCommand] = []
        self.queue.put_nowait(pb.ExecutorMessage(register=pb.ExecutorRegister(
            executor_id=executor_id, address=f"addr-{executor_id}", model="m", num_blocks=64, block_size=16,
            max_model_len=4096, startup_s=startup_s)))
        self.task = asyncio.create_task(self._run(stub))

    async def _messages(self):
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _run(self, stub):
        async for cmd in stub.Connect(self._messages()):
            self.commands.append(cmd)

    def kinds(self) -> list[tuple[str, bool]]:
        return [(c.WhichOneof("kind"), c.drain_ack.done) for c in self.commands]

    async def close(self):
        self.queue.put_nowait(None)
        await asyncio.wait_for(self.task, 60)


async def admit(stub, rid: str) -> pb.Assignment:
    events = [e async for e in stub.Admit(pb.AdmitRequest(request_id=rid, tenant="t", model="m",
                                                           num_prompt_tokens=15, max_tokens=16))]
    return events[-1].assignment


async def test_a_draining_executor_gets_nothing_new_and_may_leave_once_its_leases_are_released():
    """C42: X holds a lease (its request may still be on its way); X drains: the scheduler
    acknowledges at once, routes every new request to Y, and says X may leave (done) only
    after X's last lease is released; X's leaving voids nothing."""
    svc = await start_scheduler(0, planner=PlannerConfig(interval_s=60.0, season_s=3600.0))
    core = svc.servicer.core
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    x = RecordingExecutor(stub, "x", startup_s=42.5)
    try:
        await wait_for_condition(lambda: x.kinds() == [("registered", False)], 60, "x registered")
        in_flight = await admit(stub, "r1")
        assert in_flight.executor_id == "x"
        y = RecordingExecutor(stub, "y")
        await wait_for_condition(lambda: y.kinds() == [("registered", False)], 60, "y registered")
        x.queue.put_nowait(pb.ExecutorMessage(draining=pb.ExecutorDraining(grace_s=30.0)))
        await wait_for_condition(lambda: len(x.commands) == 2, 60, "drain acknowledged")
        assert x.kinds() == [("registered", False), ("drain_ack", False)] and core.registry.get("x").draining
        assigned = [await admit(stub, f"new-{i}") for i in range(3)]
        assert [a.executor_id for a in assigned] == ["y", "y", "y"]
        x.queue.put_nowait(pb.ExecutorMessage(capacity=pb.CapacityReport(num_free_blocks=63, num_running=1,
                                                                          lease_ids=[in_flight.lease_id])))
        await wait_for_condition(lambda: core.lease(in_flight.lease_id).acked, 60, "report applied")
        assert len(x.commands) == 2  # a lease of x remains: not done
        await stub.Release(pb.ReleaseRequest(lease_id=in_flight.lease_id, num_completion_tokens=16))
        x.queue.put_nowait(pb.ExecutorMessage(capacity=pb.CapacityReport(num_free_blocks=64)))
        await wait_for_condition(lambda: len(x.commands) == 3, 60, "drain done")
        assert x.kinds()[-1] == ("drain_ack", True)
        await x.close()
        await wait_for_condition(lambda: core.registry.get("x") is None, 60, "x gone")
        assert sorted(lease.executor_id for lease in core.registry.get("y").leases.values()) == ["y", "y", "y"]
        assert svc.servicer.planner.cold_start_s == 42.5  # x's measured cold start
        for a in assigned:
            await stub.Release(pb.ReleaseRequest(lease_id=a.lease_id))
        await y.close()
    finally:
        await channel.close()
        await svc.stop(0.1)


async def test_a_lease_detached_by_a_lost_link_holds_the_drain_until_it_is_released():
    """Found by a review: x lost its link with a lease whose request had not reached it
    yet (detached, not listed again); x came back and drained, and was told it may
    leave at once, while that lease was still live and routed to x."""
    svc = await start_scheduler(0, planner=PlannerConfig(interval_s=60.0, season_s=3600.0))
    core = svc.servicer.core
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    x = RecordingExecutor(stub, "x")
    try:
        await wait_for_condition(lambda: x.kinds() == [("registered", False)], 60, "x registered")
        pending = await admit(stub, "r1")          # its gateway has not called Execute yet
        await x.close()                            # the link drops: the lease is detached
        await wait_for_condition(lambda: core.registry.get("x") is None, 60, "x dropped")
        assert (core.lease(pending.lease_id).executor_id, core.num_leases("x")) == ("x", 1)
        x = RecordingExecutor(stub, "x")           # back, and stopping
        x.queue.put_nowait(pb.ExecutorMessage(draining=pb.ExecutorDraining(grace_s=30.0)))
        x.queue.put_nowait(pb.ExecutorMessage(capacity=pb.CapacityReport(num_free_blocks=64)))
        await wait_for_condition(lambda: core.registry.get("x") is not None and core.registry.get("x").draining,
                                 60, "x draining")
        await wait_for_condition(lambda: len(x.commands) >= 2, 60, "drain acknowledged")
        assert x.kinds() == [("registered", False), ("drain_ack", False)]  # the detached lease remains
        await stub.Release(pb.ReleaseRequest(lease_id=pending.lease_id))
        x.queue.put_nowait(pb.ExecutorMessage(capacity=pb.CapacityReport(num_free_blocks=64)))
        await wait_for_condition(lambda: len(x.commands) == 3, 60, "drain done")
        assert x.kinds()[-1] == ("drain_ack", True) and core.num_leases("x") == 0
        await x.close()
    finally:
        await channel.close()
        await svc.stop(0.1)


async def test_planner_metrics_are_exported_after_a_decision():
    svc = await start_scheduler(0, planner=PlannerConfig(interval_s=60.0, season_s=3600.0, min_executors=2,
                                                         capacity_tokens_per_s=500.0, cold_start_s=12.0))
    try:
        await svc.servicer.planner_loop.tick()
        text = generate_latest(svc.servicer.metrics.registry).decode()
        assert "meshserve_scheduler_desired_executors 2.0" in text
        assert "meshserve_scheduler_executor_capacity_tokens_per_second 500.0" in text
        assert "meshserve_scheduler_cold_start_seconds 12.0" in text
        assert "meshserve_scheduler_forecast_tokens_per_second 0.0" in text  # no history yet
        assert "meshserve_scheduler_executors_draining 0.0" in text
    finally:
        await svc.stop(0.1)
