"""The task runner over real stores: final states from the work's outcome, tenancy,
cancellation (local, and from another gateway sharing a Redis store), shutdown."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from gateway.redis_task_store import RedisTaskStore
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore, TaskRecord, TaskState
from meshserve.errors import NotFound, ResourceExhausted, Unavailable


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def settle(runner: TaskRunner, timeout_s: float = 120.0) -> None:
    """Waits until no task runs; ``timeout_s`` only bounds a hang."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while runner.num_running:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{runner.num_running} tasks still running")
        await asyncio.sleep(0.01)


def new(task_id: str, tenant: str = "acme") -> TaskRecord:
    return TaskRecord(task_id, tenant, request_id=task_id, created_at=1.0)


async def test_success_stores_the_result_and_the_times():
    runner = TaskRunner(MemoryTaskStore(), clock=Clock())
    started = asyncio.Event()

    async def work(mark_running):
        await mark_running()
        started.set()
        return b"tokens"

    submitted = await runner.submit(new("t1"), work)
    assert submitted.state == TaskState.QUEUED
    await settle(runner)
    rec = await runner.get("acme", "t1")
    assert (rec.state, rec.result, rec.created_at, rec.started_at, rec.finished_at) == (
        TaskState.SUCCEEDED, b"tokens", 1.0, 102.0, 103.0)  # 101: the lease of the claim
    assert started.is_set()


async def test_errors_become_failed_with_their_code():
    runner = TaskRunner(MemoryTaskStore())

    async def unavailable(_mark):
        raise Unavailable("executor executor-0: engine failed: boom")

    async def exhausted(mark):
        await mark()
        raise ResourceExhausted("scheduler: queue full")

    async def bug(_mark):
        raise KeyError("oops")

    await runner.submit(new("a"), unavailable)
    await runner.submit(new("b"), exhausted)
    await runner.submit(new("c"), bug)
    await settle(runner)
    got = [await runner.get("acme", t) for t in "abc"]
    assert [(r.state, r.error_code, r.error_message) for r in got] == [
        (TaskState.FAILED, "UNAVAILABLE", "executor executor-0: engine failed: boom"),
        (TaskState.FAILED, "RESOURCE_EXHAUSTED", "scheduler: queue full"),
        (TaskState.FAILED, "INTERNAL", "internal error: KeyError: 'oops'"),
    ]
    assert got[0].started_at == 0.0 and got[1].started_at > 0.0


async def test_other_tenants_and_unknown_ids_are_not_found():
    runner = TaskRunner(MemoryTaskStore())

    async def work(_mark):
        return b""

    await runner.submit(new("t", tenant="acme"), work)
    await settle(runner)
    for tenant, task_id in (("globex", "t"), ("acme", "nope")):
        with pytest.raises(NotFound) as info:
            await runner.get(tenant, task_id)
        assert str(info.value) == f"task {task_id!r} not found"
        with pytest.raises(NotFound):
            await runner.cancel(tenant, task_id)
    assert (await runner.get("acme", "t")).state == TaskState.SUCCEEDED


async def test_cancel_cancels_the_work_and_a_finished_task_stays():
    runner = TaskRunner(MemoryTaskStore())
    entered, cleaned = asyncio.Event(), asyncio.Event()

    async def forever(mark):
        await mark()
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()     # the gateway's work cancels its executor call here

    async def quick(_mark):
        return b"done"

    await runner.submit(new("slow"), forever)
    await runner.submit(new("fast"), quick)
    await asyncio.wait_for(entered.wait(), 60)
    rec = await runner.cancel("acme", "slow")
    assert rec.state == TaskState.CANCELLED and rec.finished_at > 0
    await asyncio.wait_for(cleaned.wait(), 60)
    await settle(runner)
    assert (await runner.get("acme", "slow")).state == TaskState.CANCELLED
    assert (await runner.cancel("acme", "fast")).state == TaskState.SUCCEEDED


async def test_a_cancel_on_another_gateway_reaches_the_running_work(redis_url):
    """Two runners share one Redis store; B cancels A's task; A's work is cancelled
    within its poll interval."""
    store_a, store_b = RedisTaskStore(redis_url, ttl_s=60), RedisTaskStore(redis_url, ttl_s=60)
    await store_a._redis.flushdb()
    a, b = TaskRunner(store_a, heartbeat_s=0.05), TaskRunner(store_b, heartbeat_s=0.05)
    entered, cleaned = asyncio.Event(), asyncio.Event()

    async def forever(mark):
        await mark()
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    await a.submit(new("shared"), forever)
    await asyncio.wait_for(entered.wait(), 60)
    assert (await b.get("acme", "shared")).state == TaskState.RUNNING
    assert (await b.cancel("acme", "shared")).state == TaskState.CANCELLED
    await asyncio.wait_for(cleaned.wait(), 60)
    await settle(a)
    assert (await a.get("acme", "shared")).state == TaskState.CANCELLED
    await store_a.close()
    await store_b.close()


async def test_close_fails_running_tasks_as_unavailable():
    runner = TaskRunner(MemoryTaskStore())
    entered = asyncio.Event()

    async def forever(_mark):
        entered.set()
        await asyncio.Event().wait()

    await runner.submit(new("t"), forever)
    await asyncio.wait_for(entered.wait(), 60)
    await runner.close()
    rec = await runner.get("acme", "t")
    assert (rec.state, rec.error_code) == (TaskState.FAILED, "UNAVAILABLE")
    assert runner.num_running == 0


async def test_a_drain_lets_a_running_task_finish_before_close():
    """A stopping gateway with the memory store: its running task finishes within the
    drain's grace and is SUCCEEDED, not failed UNAVAILABLE by the close."""
    runner = TaskRunner(MemoryTaskStore())
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(mark):
        await mark()
        entered.set()
        await release.wait()
        return b"done"

    await runner.submit(new("t"), slow)
    await asyncio.wait_for(entered.wait(), 60)
    draining = asyncio.create_task(runner.drain(600.0))
    await asyncio.sleep(0)
    assert not draining.done()
    release.set()
    await asyncio.wait_for(draining, 60)
    await runner.close()
    rec = await runner.get("acme", "t")
    assert (rec.state, rec.result) == (TaskState.SUCCEEDED, b"done")


async def test_a_drain_waits_for_a_task_submitted_by_a_call_still_in_flight():
    """The drain began with nothing running; a SubmitTask in flight then adds a task:
    the drain waits for it (the calls are done only later), so it finishes."""
    runner = TaskRunner(MemoryTaskStore())
    calls_done = asyncio.Event()
    draining = asyncio.create_task(runner.drain(600.0, calls_done))
    await asyncio.sleep(0.2)                            # two of the drain's 0.1 s looks: nothing runs yet
    assert not draining.done()
    release = asyncio.Event()

    async def slow(mark):
        await mark()
        await release.wait()
        return b"late"

    await runner.submit(new("late"), slow)
    calls_done.set()                                    # the submitting call returned
    await asyncio.sleep(0.2)
    assert not draining.done()                          # the task still runs
    release.set()
    await asyncio.wait_for(draining, 60)
    await runner.close()
    assert (await runner.get("acme", "late")).state == TaskState.SUCCEEDED


async def test_a_drain_waits_for_the_callback_a_finished_task_started():
    posted = []

    async def on_final(record):
        await asyncio.sleep(0.2)                        # the POST
        posted.append(record.task_id)

    runner = TaskRunner(MemoryTaskStore(), on_final=on_final)

    async def quick(mark):
        await mark()
        return b"ok"

    await runner.submit(replace(new("cb"), callback_url="https://hooks.example.com/x", callback_state="pending"),
                        quick)
    await asyncio.wait_for(runner.drain(600.0), 60)
    assert posted == ["cb"]
    await runner.close()


async def test_close_right_after_submit_still_runs_the_works_cleanup():
    """A gateway stopping right after a submit (before the task's first step) must still
    end the task FAILED/UNAVAILABLE and let its work run its cleanup (metrics, request id)."""
    runner = TaskRunner(MemoryTaskStore())
    cleaned = []

    async def work(_mark):
        try:
            await asyncio.sleep(30)
            return b"never"
        finally:
            cleaned.append(True)

    await runner.submit(new("t-early"), work)
    await runner.close()
    rec = await runner.get("acme", "t-early")
    assert (rec.state, rec.error_code) == (TaskState.FAILED, "UNAVAILABLE")
    assert cleaned == [True]
    assert runner.num_running == 0


@pytest.mark.parametrize("report", ["queued", "held"])
async def test_a_running_record_goes_back_to_queued_when_its_work_waits_again(report):
    """A task taken over from a dead gateway keeps the state it left (RUNNING): once its
    new work waits (in the scheduler's queue, or out a refusal) it shows QUEUED, with
    the wait; then RUNNING again once assigned."""
    store = MemoryTaskStore()
    runner = TaskRunner(store, clock=Clock())
    waiting, go = asyncio.Event(), asyncio.Event()

    async def work(hooks):
        await hooks()  # the dead gateway's attempt got this far
        if report == "queued":
            await hooks.queued(3, 1.5)
        else:
            await hooks.held("RESOURCE_EXHAUSTED: over its rate limit", 2.0)
        waiting.set()
        await go.wait()
        await hooks()
        return b"done"

    await runner.submit(new("t-wait"), work)
    await asyncio.wait_for(waiting.wait(), 30)
    rec = await store.get("t-wait")
    expected = (3, 1.5, "") if report == "queued" else (-1, 2.0, "RESOURCE_EXHAUSTED: over its rate limit")
    assert rec.state == TaskState.QUEUED and (rec.queue_position, rec.estimated_wait_s, rec.last_error) == expected
    go.set()
    await settle(runner)
    assert (await store.get("t-wait")).state == TaskState.SUCCEEDED
