"""C39 without a model: Redis stops answering (SIGSTOP: its port accepts, nothing
answers), then comes back; its client connections are killed. SubmitTask is
UNAVAILABLE while it is gone (bounded by the store's socket timeouts), the result
cache is bypassed, and afterwards every task is consumed and terminal, none lost
or duplicated; the task path's readiness probe follows Redis; an acknowledged task
survives Redis restarts when Redis runs append-only (as deployments must)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.redis_task_store import RedisTaskStore
from gateway.result_store import Coalescer, RedisResultStore
from gateway.task_readiness import TaskStoreProbe
from gateway.task_runner import TaskRunner
from gateway.task_store import TaskRecord, TaskState
from meshserve.errors import Unavailable
from tests.support.redis_server import redis_process, redis_process_or_skip


@pytest.fixture
def redis():
    yield from redis_process_or_skip()


async def until_final(store, task_id: str) -> TaskRecord:
    for _ in range(6000):  # a hang bound (60 s of 10 ms polls), not a speed check
        record = await store.get(task_id)
        if record is not None and record.state.finished:
            return record
        await asyncio.sleep(0.01)
    raise AssertionError(f"task {task_id} not final: {record}")


async def test_redis_outage_refuses_submits_bypasses_the_cache_and_loses_no_task(redis):
    """C39."""
    store = RedisTaskStore(redis.url, ttl_s=600)
    cache = RedisResultStore(redis.url)
    runner = TaskRunner(store, heartbeat_s=0.05, lease_s=30.0, claim_poll_s=0.05)
    finals = []

    async def on_final(record):
        finals.append(record.task_id)
    runner.on_final = on_final
    go = asyncio.Event()

    async def work(hooks) -> bytes:
        await go.wait()
        await hooks()
        return b"ok"

    await runner.submit(TaskRecord("before", "acme"), work)
    redis.pause()
    try:
        with pytest.raises(Unavailable):
            await runner.submit(TaskRecord("during", "acme"), work)
        async with Coalescer(cache, wait_s=1.0).flight("k" * 64) as flight:   # a miss, computed
            assert flight.cached is None
            flight.value = ()
        assert cache.errors >= 1
    finally:
        redis.resume()
    go.set()
    killer = aioredis.from_url(redis.url)
    await killer.client_kill_filter(_type="normal", skipme=True)          # every client connection dropped
    await killer.aclose()
    await runner.submit(TaskRecord("after", "acme"), work)
    records = [await until_final(store, t) for t in ("before", "after")]
    assert [(r.state, r.result, r.attempt) for r in records] == [(TaskState.SUCCEEDED, b"ok", 1)] * 2
    during = await until_final(store, "during")   # its SET may land once Redis answers: it is ended, never run
    assert (during.state, during.error_code, during.attempt) == (TaskState.FAILED, "UNAVAILABLE", 1)
    assert await store.unfinished_count("acme") == 0  # the submit refused, its record landed and ended: uncounted
    for _ in range(6000):
        if len(finals) >= 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(finals) == ["after", "before"]
    await runner.close()
    await store.close()
    await cache.close()


async def test_the_task_path_is_not_ready_while_redis_does_not_answer_and_ready_after(redis):
    """C39 (the readiness half): the probe reports NOT_SERVING once a ping goes
    unanswered past its bound, SERVING once Redis answers again; only changes are reported."""
    store = RedisTaskStore(redis.url, ttl_s=600)
    reports = []

    async def report(ready: bool) -> None:
        reports.append(ready)
    probe = TaskStoreProbe(store.check, report, timeout_s=30.0)  # an answering Redis: no slow host runs out
    assert await probe.check() is True
    redis.pause()
    probe.timeout_s = 0.2  # a Redis that does not answer: unanswered past this bound
    try:
        assert await probe.check() is False
        assert await probe.check() is False
    finally:
        redis.resume()
    probe.timeout_s = 30.0
    assert await probe.check() is True
    assert reports == [True, False, True]
    await store.close()


async def test_an_acknowledged_task_survives_redis_restarts(tmp_path):
    """C39 (the durability half): with append-only persistence and an fsync per write
    (what the deployments ship), a task acknowledged before Redis is killed and
    restarted three times is still there, still claimable, and runs once."""
    try:
        with redis_process(persist_dir=str(tmp_path)) as server:
            store = RedisTaskStore(server.url, ttl_s=600)
            runner = TaskRunner(store, heartbeat_s=0.05, lease_s=30.0, claim_poll_s=0.05)
            go = asyncio.Event()

            async def work(hooks) -> bytes:
                await go.wait()
                return b"done"
            await runner.submit(TaskRecord("kept", "acme"), work)
            for _ in range(3):
                server.restart()
            record = await store.get("kept")     # the client reconnects by itself
            assert (record.state, record.owner, record.attempt) == (TaskState.QUEUED, runner.owner, 1)
            go.set()
            done = await until_final(store, "kept")
            assert (done.state, done.result, done.attempt) == (TaskState.SUCCEEDED, b"done", 1)
            await runner.close()
            await store.close()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
