"""The scheduler's spans over loopback (fake executor, no model): queue position and
wait, executor id, the caller's parent, ERROR on a displaced request, Release."""

import asyncio

import grpc
import pytest

from meshserve.telemetry import memory_exporter
from meshserve.v1 import scheduler_pb2 as pb
from scheduler.config import SchedulerConfig
from tests.support.served_scheduler import served_scheduler

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


def metadata(span_id: int):
    return (("traceparent", f"00-{TRACE_ID:032x}-{span_id:016x}-01"),)


async def admit(stub, request_id: str, span_id: int, **kw):
    req = pb.AdmitRequest(request_id=request_id, model="m", max_tokens=16, tenant="t", **kw)
    return [e async for e in stub.Admit(req, metadata=metadata(span_id))]


@pytest.fixture
async def scheduler():
    async with served_scheduler(SchedulerConfig(max_queue_len=1, retry_after_s=0.25)) as served:
        yield served


async def test_admit_spans_carry_queue_position_wait_and_executor(scheduler):
    svc, stub = scheduler
    memory_exporter().clear()
    hold = await admit(stub, "hold", 1, num_prompt_tokens=63)             # takes all 4 blocks at once
    low = asyncio.create_task(admit(stub, "low", 2, num_prompt_tokens=15))
    while len(svc.servicer.core) == 0:
        await asyncio.sleep(0.01)
    high = asyncio.create_task(admit(stub, "high", 3, num_prompt_tokens=15, priority=1))
    with pytest.raises(grpc.aio.AioRpcError) as info:   # displaced from the 1-place queue
        await low
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.sleep(0.05)
    await stub.Release(pb.ReleaseRequest(lease_id=hold[-1].assignment.lease_id), metadata=metadata(4))
    events = await asyncio.wait_for(high, 60)
    assert [e.WhichOneof("kind") for e in events] == ["queued", "assignment"]

    spans = {}
    deadline = asyncio.get_running_loop().time() + 120  # only bounds a hang
    while asyncio.get_running_loop().time() < deadline:
        spans = {(s.name, s.attributes.get("meshserve.request_id")): s for s in memory_exporter().get_finished_spans()}
        if len(spans) == 4:
            break
        await asyncio.sleep(0.01)
    assert set(spans) == {("scheduler.admit", "hold"), ("scheduler.admit", "low"), ("scheduler.admit", "high"),
                          ("scheduler.release", None)}
    for (name, _), span in spans.items():
        assert span.context.trace_id == TRACE_ID and span.parent.is_remote and span.kind.name == "SERVER"
    first, low_span, high_span = (spans[("scheduler.admit", r)] for r in ("hold", "low", "high"))
    assert [s.parent.span_id for s in (first, low_span, high_span, spans[("scheduler.release", None)])] == [1, 2, 3, 4]
    assert "meshserve.queue.position" not in first.attributes   # placed at once
    assert (first.attributes["meshserve.executor_id"], first.attributes["meshserve.tenant"]) == ("e0", "t")
    assert high_span.attributes["meshserve.queue.position"] == 0
    assert high_span.attributes["meshserve.priority"] == 1 and high_span.attributes["meshserve.executor_id"] == "e0"
    assert high_span.attributes["meshserve.queue.wait_s"] == pytest.approx(events[-1].assignment.queue_s)
    assert high_span.attributes["meshserve.queue.wait_s"] >= 0.05
    assert low_span.status.status_code.name == "ERROR" and "displaced" in low_span.status.description
    assert "meshserve.executor_id" not in low_span.attributes
