"""Tasks the scheduler refuses for now are waited out, not failed: a tenant over
its ``requests_per_s`` gets its task QUEUED with the refusal as ``last_error``
and the delay as ``estimated_wait_s``, then admitted again and SUCCEEDED with
the same tokens; the waiting task keeps its request id; ``CancelTask`` ends such
a wait. A tenant's waiting tasks are admitted in the order they came, at about one
refusal each; a wait past ``--task-max-wait-s`` fails the task. A request that
alone exceeds its tenant's KV quota never fits: its task FAILS with
RESOURCE_EXHAUSTED at once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from gateway.request import ModelInfo
from gateway.result_cache import ResultCache
from gateway.server import start_gateway
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, cancel_task, channel, get_task, submit_task, wait_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.tenant_limits import TenantLimits
from tests.support.engines import make_engine
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh, wait_for_condition

PACED = (("x-api-key", "key-paced"),)  # one request every 2 s
FAST = (("x-api-key", "key-fast"),)  # 4 requests/s: a burst of 4, then one every 0.25 s
SMALL = (("x-api-key", "key-small"),)  # a KV quota of 1 block
REQUEST = build_request([(7 * i) % 500 + 40 for i in range(12)], max_tokens=4, temperature=0.0,
                        ignore_eos=True)


class SchedulerClock:
    """The scheduler's clock here: held still, so that a rate-limit bucket refills only when
    a test ``advance``s it, whatever time a loaded host takes between two admissions; or,
    after ``run``, going on from where it stood at the real clock's pace."""

    def __init__(self) -> None:
        self.held_at, self.running_since = 1000.0, None

    def __call__(self) -> float:
        if self.running_since is None:
            return self.held_at
        return self.held_at + time.monotonic() - self.running_since

    def advance(self, seconds: float) -> None:
        assert self.running_since is None, "advance a held clock"
        self.held_at += seconds

    def run(self) -> None:
        self.running_since = time.monotonic()

    def hold(self) -> None:
        self.held_at, self.running_since = self(), None


@pytest_asyncio.fixture(scope="module")
async def limited_mesh(tokenizer, tmp_path_factory):
    tenants_file = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants_file.write_text('[[tenants]]\nname = "paced"\napi_keys = ["key-paced"]\nrequests_per_s = 0.5\n'
                            '[[tenants]]\nname = "fast"\napi_keys = ["key-fast"]\nrequests_per_s = 4.0\n'
                            '[[tenants]]\nname = "small"\napi_keys = ["key-small"]\nkv_quota_blocks = 1\n')
    config = SchedulerConfig(tenant_limits={"paced": TenantLimits(requests_per_s=0.5),
                                            "fast": TenantLimits(requests_per_s=4.0), "small": TenantLimits()},
                             tenant_quotas={"small": 1}, executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S)
    tenants = TenantRegistry.from_file(tenants_file)
    clock = SchedulerClock()
    mesh = await start_local_mesh([make_engine()], tokenizer, tenants=tenants, scheduler_config=config,
                                  scheduler_clock=clock)
    mesh.tenants, mesh.clock = tenants, clock
    yield mesh
    await mesh.stop()


async def held(stub, task_id: str) -> gateway_pb2.TaskStatus:
    """The task's status once it records a refusal it waits out (or once it is final)."""
    for _ in range(2400):
        status = await get_task(stub, task_id, metadata=PACED)
        if status.last_error or status.state not in (gateway_pb2.TASK_STATE_QUEUED, gateway_pb2.TASK_STATE_RUNNING):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} never recorded a refusal")


async def test_a_rate_limited_task_waits_its_turn_and_succeeds_and_one_cancelled_while_waiting_ends(limited_mesh):
    stub, clock = limited_mesh.stub, limited_mesh.clock
    first = await submit_task(stub, REQUEST, metadata=PACED)  # the bucket's one request
    await wait_task(stub, first.task_id, metadata=PACED, poll_s=0.05, timeout_s=300)
    request = gateway_pb2.GenerateRequest()
    request.CopyFrom(REQUEST)
    request.request_id = "job-2"
    second = await submit_task(stub, request, metadata=PACED)  # over 0.5 requests/s: refused for now
    status = await held(stub, second.task_id)
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the waiting task still holds its request id
        await submit_task(stub, request, metadata=PACED)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert status.state == gateway_pb2.TASK_STATE_QUEUED and not status.HasField("queue_position")
    assert status.last_error.startswith("RESOURCE_EXHAUSTED: scheduler: tenant 'paced' is over its rate limit")
    assert 0.0 < status.estimated_wait_s <= 2.0
    clock.advance(2.0)  # the bucket refills: the second's next ask, after its wait, is admitted
    done = [await wait_task(stub, t.task_id, metadata=PACED, poll_s=0.05, timeout_s=300) for t in (first, second)]
    assert [d.state for d in done] == [gateway_pb2.TASK_STATE_SUCCEEDED] * 2
    assert done[1].attempt == 1 and done[1].started_at_unix_s > done[0].started_at_unix_s
    assert list(done[1].choices[0].token_ids) == list(done[0].choices[0].token_ids)
    assert len(done[0].choices[0].token_ids) == 4

    third = await submit_task(stub, REQUEST, metadata=PACED)  # the bucket is empty again (the clock held): held
    await held(stub, third.task_id)
    cancelled = await cancel_task(stub, third.task_id, metadata=PACED)
    assert cancelled.state == gateway_pb2.TASK_STATE_CANCELLED
    core = limited_mesh.scheduler.servicer.core
    await wait_for_condition(lambda: core.num_leases() == 0 and len(core) == 0, what="nothing held for the tasks")
    engine = limited_mesh.engines[0]
    await wait_for_condition(lambda: engine.stats().num_free_blocks == engine.num_blocks, what="every block back")


async def test_a_task_that_never_fits_its_tenant_quota_fails_at_once(limited_mesh):
    stub = limited_mesh.stub
    big = build_request(list(range(40, 80)), max_tokens=4, temperature=0.0)  # 3 blocks > 1
    handle = await submit_task(stub, big, metadata=SMALL)
    status = await wait_task(stub, handle.task_id, metadata=SMALL, poll_s=0.05, timeout_s=300)
    assert status.state == gateway_pb2.TASK_STATE_FAILED and status.error.code == "RESOURCE_EXHAUSTED"
    assert "tenant 'small' has a quota of 1 blocks" in status.error.message
    assert status.attempt == 1 and status.last_error == ""


def _sample(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"tenant": "fast", "priority": "0", **labels}) or 0.0


async def test_a_tenants_waiting_tasks_all_succeed_at_about_one_refusal_each(limited_mesh):
    stub = limited_mesh.stub
    gateway = limited_mesh.gateway.servicer.core.metrics.registry
    scheduler = limited_mesh.scheduler.servicer.metrics.registry
    before = {name: _sample(gateway, name, **labels) for name, labels in (
        ("meshserve_requests_total", {"outcome": "ok"}), ("meshserve_request_prompt_tokens_total", {}))}
    refused_before = _sample(scheduler, "meshserve_scheduler_requests_rejected_total", code="resource_exhausted")
    clock = limited_mesh.clock

    async def run_the_clock_at_the_first_refusal():
        # held until then, the burst of 4 fits and no more, however slowly the submits come; then
        # the bucket refills at its rate while the waiting tasks ask again
        while _sample(scheduler, "meshserve_scheduler_requests_rejected_total",
                      code="resource_exhausted") == refused_before:
            await asyncio.sleep(0.005)
        clock.run()

    running = asyncio.create_task(run_the_clock_at_the_first_refusal())
    try:
        handles = [await submit_task(stub, REQUEST, metadata=FAST) for _ in range(8)]  # a burst of 4 fits
        done = [await wait_task(stub, h.task_id, metadata=FAST, poll_s=0.05, timeout_s=300) for h in handles]
    finally:
        running.cancel()
        clock.hold()
    assert [d.state for d in done] == [gateway_pb2.TASK_STATE_SUCCEEDED] * 8
    # the tasks that waited carry their refusal: the first one refused, and those that asked before
    # it made the line busy (4 when the submits come faster than the scheduler's answer, fewer else)
    waited = [d for d in done if "over its rate limit" in d.last_error]
    # (their order: first refused, first admitted, is checked in tests/gateway/test_task_wait.py; here
    # the tasks reach the scheduler in the order their works run, not always the order of submission)
    assert 1 <= len(waited) <= 4
    refused = _sample(scheduler, "meshserve_scheduler_requests_rejected_total", code="resource_exhausted") \
        - refused_before
    # each waiting task: its first refusal, at most one more at the head of the line (not N²/2)
    assert len(waited) <= refused <= 2 * len(waited)
    # the gateway counts each task once, however often it was refused: 8 requests, 8 prompts
    assert _sample(gateway, "meshserve_requests_total", outcome="ok") - before["meshserve_requests_total"] == 8
    assert _sample(gateway, "meshserve_request_prompt_tokens_total") \
        - before["meshserve_request_prompt_tokens_total"] == 8 * 12  # 12-token prompts
    assert _sample(gateway, "meshserve_requests_total", outcome="resource_exhausted") == 0


async def test_a_task_that_would_wait_past_the_bound_fails_with_the_refusal(limited_mesh, tokenizer):
    e0 = limited_mesh.engines[0]
    info = ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision)
    svc = await start_gateway(tokenizer, info, limited_mesh.scheduler.address, 0, tenants=limited_mesh.tenants,
                              tasks=TaskRunner(MemoryTaskStore(), max_wait_s=1.0), tls=limited_mesh.tls("gateway"))
    try:
        async with channel(svc.address, limited_mesh.tls("client")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            handles = [await submit_task(stub, REQUEST, metadata=PACED) for _ in range(2)]
            statuses = [await wait_task(stub, h.task_id, metadata=PACED, poll_s=0.05, timeout_s=300)
                        for h in handles]
        failed = [s for s in statuses if s.state == gateway_pb2.TASK_STATE_FAILED]
        assert len(failed) >= 1 and all(s.error.code == "RESOURCE_EXHAUSTED" for s in failed)
        assert failed[-1].error.message.endswith("may wait at most 1 s (--task-max-wait-s)")
        assert "over its rate limit of 0.5 requests/s" in failed[-1].error.message
        registry = svc.servicer.core.metrics.registry  # each task counted once, with its own outcome
        outcomes = {o: registry.get_sample_value("meshserve_requests_total", {
            "tenant": "paced", "priority": "0", "outcome": o}) or 0.0 for o in ("ok", "resource_exhausted")}
        assert outcomes == {"ok": 2.0 - len(failed), "resource_exhausted": float(len(failed))}
    finally:
        await svc.stop(0.5)
        await svc.servicer.close()


async def test_a_task_the_result_cache_answers_does_not_wait_behind_its_tenants_line(limited_mesh, tokenizer):
    """Found by a review: a cache hit waited behind its tenant's refused tasks."""
    e0 = limited_mesh.engines[0]
    info = ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision)
    svc = await start_gateway(tokenizer, info, limited_mesh.scheduler.address, 0, tenants=limited_mesh.tenants,
                              result_cache=ResultCache(16, ttl_s=600.0), tls=limited_mesh.tls("gateway"))
    other = build_request([(5 * i) % 400 + 60 for i in range(12)], max_tokens=4, temperature=0.0, ignore_eos=True)
    clock = limited_mesh.clock
    clock.advance(2.0)  # the paced bucket holds its one request (it stays empty after, the clock held)
    try:
        async with channel(svc.address, limited_mesh.tls("client")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            first = await wait_task(stub, (await submit_task(stub, REQUEST, metadata=PACED)).task_id,
                                    metadata=PACED, poll_s=0.05, timeout_s=300)  # now in the result cache
            behind = await submit_task(stub, other, metadata=PACED)  # refused for now: the line is busy
            await held(stub, behind.task_id)
            hit = await wait_task(stub, (await submit_task(stub, REQUEST, metadata=PACED)).task_id,
                                  metadata=PACED, poll_s=0.05, timeout_s=300)
            still = await get_task(stub, behind.task_id, metadata=PACED)
            assert hit.state == gateway_pb2.TASK_STATE_SUCCEEDED and hit.choices[0].result.cached
            assert list(hit.choices[0].token_ids) == list(first.choices[0].token_ids) and hit.last_error == ""
            assert still.state == gateway_pb2.TASK_STATE_QUEUED  # the hit did not wait for it
            clock.advance(2.0)  # the bucket refills: behind's next ask is admitted
            final = await wait_task(stub, behind.task_id, metadata=PACED, poll_s=0.05, timeout_s=300)
            assert final.state == gateway_pb2.TASK_STATE_SUCCEEDED
    finally:
        await svc.stop(0.5)
        await svc.servicer.close()
