"""Durable tasks on a real redis-server, without a model: two runners (two gateways)
share one store; leases lapse on a fake clock; the works are coroutines the tests
control. A gateway that dies, stalls or stops leaves its tasks to the other, each
with exactly one final state, one result and one ``on_final`` (callback)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.redis_task_store import RedisTaskStore
from gateway.task_runner import TaskRunner
from gateway.task_store import TaskRecord, TaskState
from meshserve.errors import Unavailable
from tests.support.mesh_harness import wait_for_condition

LEASE_S = 10.0


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gateway:
    """One runner with its own store connection, whose resumed works return
    ``name`` (so a result tells which gateway produced it) and whose final
    transitions are counted."""

    def __init__(self, url: str, clock: FakeClock, name: str, finals: list, max_attempts: int = 3):
        self.name = name
        self.resumed: list[TaskRecord] = []
        self.store = RedisTaskStore(url, ttl_s=600)

        async def on_final(record: TaskRecord) -> None:
            finals.append((name, record.task_id, record.state, record.result))

        self.runner = TaskRunner(self.store, clock, heartbeat_s=0.02, owner=name, lease_s=LEASE_S,
                                 claim_poll_s=0.02, max_attempts=max_attempts, retry_backoff_s=0.0,
                                 resume=self._resume, on_final=on_final)

    def _resume(self, record: TaskRecord):
        self.resumed.append(record)

        async def work(hooks) -> bytes:
            await hooks()
            return self.name.encode()
        return work

    def crash(self) -> None:
        """The process died (SIGKILL): its loops and works stop, nothing more is written."""
        self.runner._closing = True
        for loop in self.runner._loops:
            loop.cancel()
        for running in self.runner._running.values():
            running.lost = True
            running.task.cancel()

    def stall(self) -> None:
        """The process stopped (SIGSTOP): it renews no lease, claims nothing; its works go on."""
        self.runner._closing = True
        for loop in self.runner._loops:
            loop.cancel()


@pytest.fixture
async def pair(redis_url):
    clock, finals = FakeClock(), []
    a, b = Gateway(redis_url, clock, "gw-a", finals), Gateway(redis_url, clock, "gw-b", finals)
    await a.store._redis.flushdb()
    yield a, b, clock, finals
    for gw in (a, b):
        await gw.runner.close()
        await gw.store.close()


def new(task_id: str) -> TaskRecord:
    return TaskRecord(task_id, "acme", request_id=task_id, created_at=1.0, request=b"stored request")


async def blocked(hooks) -> bytes:
    await hooks()
    await asyncio.Event().wait()
    return b"never"


def held_until_released(result: bytes):
    """A work that marks itself running, then waits for the returned event; it returns ``result``."""
    release = asyncio.Event()

    async def work(hooks) -> bytes:
        await hooks()
        await release.wait()
        return result
    return release, work


async def final_state(store, task_id: str) -> TaskRecord:
    """The record once it is finished (polled; the bound only catches a hang)."""
    holder = {}

    async def poll() -> bool:
        holder["r"] = await store.get(task_id)
        return holder["r"] is not None and holder["r"].state.finished

    deadline = asyncio.get_running_loop().time() + 60
    while not await poll():
        assert asyncio.get_running_loop().time() < deadline, holder["r"]
        await asyncio.sleep(0.01)
    return holder["r"]


async def test_a_killed_gateways_tasks_are_finished_by_the_other_once(pair):
    a, b, clock, finals = pair
    b.runner.start()
    for i in range(8):
        await a.runner.submit(new(f"t{i}"), blocked)
    await wait_for_condition(lambda: a.runner.num_running == 8, what="8 tasks running on A")
    a.crash()
    assert await b.store.claimable(clock()) == []      # A's leases are still live: nothing is taken
    assert await b.store.unfinished_count("acme") == 8  # A's tasks count for their tenant on B too
    clock.now += LEASE_S + 0.1                          # ... until they lapse
    records = [await final_state(b.store, f"t{i}") for i in range(8)]
    assert [(r.state, r.result, r.attempt) for r in records] == [(TaskState.SUCCEEDED, b"gw-b", 2)] * 8
    assert await b.store.unfinished_count("acme") == 0  # B's final writes uncount what A's submits counted
    await wait_for_condition(lambda: len(finals) >= 8, what="8 final callbacks")
    assert sorted(f[1] for f in finals) == [f"t{i}" for i in range(8)] and {f[0] for f in finals} == {"gw-b"}
    assert [r.request for r in b.resumed] == [b"stored request"] * 8
    assert await b.store.claimable(clock.now + 3600) == []


async def test_a_stalled_holders_late_result_is_refused_by_its_attempt(pair):
    """C38: the holder of a task stops (SIGSTOP) past its lease; the other gateway
    reclaims and finishes it; the resumed holder's result is refused: one final
    result, one callback."""
    a, b, clock, finals = pair
    b.runner.start()
    release, slow = held_until_released(b"gw-a late")
    await a.runner.submit(new("held"), slow)
    await wait_for_condition(lambda: a.runner.num_running == 1, what="A running")
    a.stall()
    clock.now += LEASE_S + 0.1
    record = await final_state(b.store, "held")
    assert (record.state, record.result, record.attempt) == (TaskState.SUCCEEDED, b"gw-b", 2)
    release.set()                                       # SIGCONT: A's work ends and tries to write
    await wait_for_condition(lambda: a.runner.num_running == 0 and not a.runner._finals, what="A's work ended")
    again = await b.store.get("held")
    assert (again.state, again.result, again.attempt) == (TaskState.SUCCEEDED, b"gw-b", 2)
    assert finals == [("gw-b", "held", TaskState.SUCCEEDED, b"gw-b")]


async def test_a_live_holder_keeps_its_task(pair):
    """C38, first run: while the holder heartbeats, the other gateway never claims its task."""
    a, b, clock, finals = pair
    b.runner.start()
    await a.runner.submit(new("kept"), blocked)
    for _ in range(5):                                  # five lease lengths pass, A renewing meanwhile
        renewed = (await a.store.get("kept")).lease_until
        clock.now += LEASE_S / 2
        await wait_for_condition(lambda: a.runner.num_running == 1)
        while (await a.store.get("kept")).lease_until == renewed:
            await asyncio.sleep(0.01)
    record = await a.store.get("kept")
    assert (record.state, record.owner, record.attempt) == (TaskState.RUNNING, "gw-a", 1)
    assert b.resumed == [] and finals == []


async def test_a_stopping_gateway_hands_its_tasks_back(pair):
    """SIGTERM: the tasks are not failed; they go back QUEUED and unowned, and the other
    gateway takes them at once (no lease to wait for)."""
    a, b, clock, finals = pair
    for i in range(3):
        await a.runner.submit(new(f"s{i}"), blocked)
    await wait_for_condition(lambda: a.runner.num_running == 3, what="3 running on A")
    await a.runner.close()
    handed = [await a.store.get(f"s{i}") for i in range(3)]
    assert [(r.state, r.owner, r.attempt, r.last_error) for r in handed] == [
        (TaskState.QUEUED, "", 1, "handed back: its gateway stopped")] * 3
    b.runner.start()
    records = [await final_state(b.store, f"s{i}") for i in range(3)]
    assert [(r.state, r.result, r.attempt) for r in records] == [(TaskState.SUCCEEDED, b"gw-b", 2)] * 3
    with pytest.raises(Unavailable):
        await a.runner.submit(new("late"), blocked)      # a stopping gateway accepts no task


async def test_a_running_report_cut_short_by_the_stop_lands_before_the_hand_back(pair):
    """The stop cancels a work while its RUNNING report is on its way to the store (a
    compare-and-set once sent completes): the hand-back waits for it, so the record ends
    QUEUED and unowned, never RUNNING with no owner."""
    a, b, clock, finals = pair
    sent, landed, store = asyncio.Event(), asyncio.Event(), a.store
    real = store.transition

    async def slow_running(task_id, from_states, to_state, **changes):
        if to_state != TaskState.RUNNING:
            return await real(task_id, from_states, to_state, **changes)

        async def in_flight():  # sent: it completes whatever its caller does, as the store's shielded calls
            sent.set()
            await asyncio.sleep(0.2)
            try:
                return await real(task_id, from_states, to_state, **changes)
            finally:
                landed.set()
        return await asyncio.shield(asyncio.ensure_future(in_flight()))

    store.transition = slow_running
    await a.runner.submit(new("late"), blocked)
    await sent.wait()
    await a.runner.close()
    await asyncio.wait_for(landed.wait(), 10)  # (already, with the hand-back after it)
    record = await a.store.get("late")
    assert (record.state, record.owner, record.attempt, record.last_error) == (
        TaskState.QUEUED, "", 1, "handed back: its gateway stopped")


async def test_a_draining_gateway_claims_nothing_and_lets_its_running_task_finish(pair):
    """A stopping gateway's drain: B's task, handed back while A drains, is not claimed
    by A (it would only be handed back again, one attempt used); A's own running task
    finishes within the grace (attempt 1, its result), and the drain returns then."""
    a, b, clock, finals = pair
    release, slow = held_until_released(b"gw-a own")
    await a.runner.submit(new("own"), slow)
    await wait_for_condition(lambda: a.runner.num_running == 1, what="A running its task")
    draining = asyncio.create_task(a.runner.drain(600.0))
    await b.runner.submit(new("left"), blocked)
    await wait_for_condition(lambda: b.runner.num_running == 1, what="B running its task")
    await b.runner.close()                              # B stops: "left" is handed back, claimable at once
    assert (await b.store.claimable(clock())) == ["left"]
    for _ in range(20):                                 # A's takeover loop polls every 0.02 s: 20 polls
        await a.runner._take_over()
    assert not draining.done() and a.runner.num_running == 1
    left = await a.store.get("left")
    assert (left.state, left.owner, left.attempt) == (TaskState.QUEUED, "", 1)
    release.set()
    await asyncio.wait_for(draining, 60)                # returns once its own task finished
    own = await final_state(a.store, "own")
    assert (own.state, own.result, own.attempt) == (TaskState.SUCCEEDED, b"gw-a own", 1)
    assert (await a.store.get("left")).attempt == 1     # still unclaimed


async def test_a_takeover_step_under_way_when_the_drain_begins_runs_its_task_to_the_end(pair):
    """A's takeover is claiming B's handed-back task (the claim takes 0.2 s here) when
    A's drain begins: the drain waits for that step, and the task it claimed runs to
    its end on A (attempt 2) instead of being handed back again (attempt 3 later)."""
    a, b, clock, finals = pair
    await b.runner.submit(new("left"), blocked)
    await wait_for_condition(lambda: b.runner.num_running == 1, what="B running")
    await b.runner.close()                              # handed back, claimable at once
    claim, entered = a.store.claim, asyncio.Event()

    async def slow_claim(*args, **kwargs):
        entered.set()
        await asyncio.sleep(0.2)
        return await claim(*args, **kwargs)

    a.store.claim = slow_claim
    step = asyncio.create_task(a.runner._take_over())
    await asyncio.wait_for(entered.wait(), 60)
    await asyncio.wait_for(a.runner.drain(600.0), 60)  # returns once the claimed task finished
    await step
    record = await a.store.get("left")
    assert (record.state, record.result, record.attempt) == (TaskState.SUCCEEDED, b"gw-a", 2)


async def test_a_drain_returns_after_its_grace_and_close_hands_the_rest_back(pair):
    a, b, clock, finals = pair
    await a.runner.submit(new("long"), blocked)
    await wait_for_condition(lambda: a.runner.num_running == 1, what="A running")
    await a.runner.drain(0.2)                           # the grace passes: the task still runs
    assert a.runner.num_running == 1
    await a.runner.close()
    record = await a.store.get("long")
    assert (record.state, record.owner, record.last_error) == (TaskState.QUEUED, "", "handed back: its gateway stopped")


async def test_an_executor_lost_mid_task_is_retried_with_one_result(pair):
    a, b, clock, finals = pair

    async def executor_died(hooks) -> bytes:
        await hooks()
        raise Unavailable("executor executor-0: stream ended: connection reset")

    await a.runner.submit(new("retried"), executor_died)
    record = await final_state(a.store, "retried")
    assert (record.state, record.result, record.attempt) == (TaskState.SUCCEEDED, b"gw-a", 2)
    assert record.last_error == "attempt 1: UNAVAILABLE: executor executor-0: stream ended: connection reset"
    await wait_for_condition(lambda: len(finals) >= 1)
    assert finals == [("gw-a", "retried", TaskState.SUCCEEDED, b"gw-a")]


async def test_attempts_are_bounded_and_the_reason_kept(redis_url):
    clock, finals = FakeClock(), []
    a = Gateway(redis_url, clock, "gw-a", finals, max_attempts=2)
    await a.store._redis.flushdb()

    async def always_down(hooks) -> bytes:
        raise Unavailable("scheduler: no executor registered")

    a._resume = lambda record: always_down
    a.runner.resume = a._resume
    await a.runner.submit(new("doomed"), always_down)
    record = await final_state(a.store, "doomed")
    assert (record.state, record.attempt, record.error_code, record.error_message) == (
        TaskState.FAILED, 2, "UNAVAILABLE", "scheduler: no executor registered")
    assert record.last_error == "attempt 1: UNAVAILABLE: scheduler: no executor registered"
    await wait_for_condition(lambda: len(finals) >= 1)
    assert [f[2] for f in finals] == [TaskState.FAILED]
    await a.runner.close()
    await a.store.close()


async def test_a_task_whose_gateways_keep_dying_fails_with_a_reason(redis_url):
    clock, finals = FakeClock(), []
    a, b = (Gateway(redis_url, clock, name, finals, max_attempts=1) for name in ("gw-a", "gw-b"))
    await a.store._redis.flushdb()
    await a.runner.submit(new("orphan"), blocked)
    await wait_for_condition(lambda: a.runner.num_running == 1)
    a.crash()
    b.runner.start()
    clock.now += LEASE_S + 0.1
    record = await final_state(b.store, "orphan")
    assert (record.state, record.attempt, record.error_code) == (TaskState.FAILED, 2, "UNAVAILABLE")
    assert record.error_message == "gave up after 1 attempts (its gateway stopped)"
    await wait_for_condition(lambda: len(finals) >= 1)
    assert b.resumed == [] and [f[0] for f in finals] == ["gw-b"]
    for gw in (a, b):
        await gw.runner.close()
        await gw.store.close()


async def test_queue_position_is_in_the_record_while_waiting(pair):
    a, b, clock, finals = pair
    waiting, go = asyncio.Event(), asyncio.Event()

    async def queued_then_assigned(hooks) -> bytes:
        await hooks.queued(3, 1.5)
        await hooks.queued(3, 1.5)                      # unchanged: not written again
        waiting.set()
        await go.wait()
        await hooks()
        return b"done"

    await a.runner.submit(new("q"), queued_then_assigned)
    await asyncio.wait_for(waiting.wait(), 60)
    record = await a.store.get("q")
    assert (record.state, record.queue_position, record.estimated_wait_s) == (TaskState.QUEUED, 3, 1.5)
    go.set()
    done = await final_state(a.store, "q")
    assert (done.state, done.queue_position, done.result) == (TaskState.SUCCEEDED, -1, b"done")


def test_the_status_shows_queue_position_attempts_and_callback_delivery():
    from gateway.task_api import to_status
    from meshserve.v1 import gateway_pb2

    waiting = TaskRecord("t", "acme", state=TaskState.QUEUED, queue_position=2, estimated_wait_s=0.75, attempt=2,
                         last_error="attempt 1: UNAVAILABLE: executor gone", callback_url="https://h.example.com/x",
                         callback_state="pending")
    status = to_status(waiting)
    assert (status.queue_position, status.estimated_wait_s, status.attempt, status.last_error) == (
        2, 0.75, 2, "attempt 1: UNAVAILABLE: executor gone")
    assert (status.callback.url, status.callback.state, status.callback.attempts) == (
        "https://h.example.com/x", gateway_pb2.CALLBACK_STATE_PENDING, 0)
    running = to_status(TaskRecord("t", "acme", state=TaskState.RUNNING, attempt=1))
    assert not running.HasField("queue_position") and not running.HasField("estimated_wait_s")
    assert not running.HasField("callback")
    failed = to_status(TaskRecord("t", "acme", state=TaskState.SUCCEEDED, callback_url="https://h.example.com/x",
                                  callback_state="failed", callback_attempts=5, callback_error="HTTP 503"))
    assert (failed.callback.state, failed.callback.attempts, failed.callback.error) == (
        gateway_pb2.CALLBACK_STATE_FAILED, 5, "HTTP 503")


async def test_a_task_that_cannot_be_resumed_fails_with_its_reason(redis_url):
    """A taken-over record whose request cannot be run again ends FAILED with the reason."""
    from meshserve.errors import InvalidArgument

    clock, finals = FakeClock(), []
    a, b = (Gateway(redis_url, clock, name, finals) for name in ("gw-a", "gw-b"))
    await a.store._redis.flushdb()

    def unresumable(record):
        raise InvalidArgument(f"task {record.task_id} has no stored request to run again")

    b.runner.resume = unresumable
    await a.runner.submit(new("lost"), blocked)
    await wait_for_condition(lambda: a.runner.num_running == 1)
    a.crash()
    b.runner.start()
    clock.now += LEASE_S + 0.1
    record = await final_state(b.store, "lost")
    assert (record.state, record.error_code, record.error_message, record.attempt) == (
        TaskState.FAILED, "INVALID_ARGUMENT", "task lost has no stored request to run again", 2)
    for gw in (a, b):
        await gw.runner.close()
        await gw.store.close()
