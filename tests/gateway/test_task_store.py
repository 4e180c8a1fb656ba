"""The task store: one test-suite run against both backends (memory and a real
redis-server), plus the memory store's bound and the URL parsing."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis

from gateway.redis_connection import StoreUnfit, server_version, version_unfit
from gateway.redis_task_store import (KEY_PREFIX, LEASES_KEY, SWEPT_PREFIX, UNFINISHED_PREFIX, RedisTaskStore, decode,
                                      encode)
from gateway.task_store import FINISHED, UNFINISHED, MemoryTaskStore, TaskRecord, TaskState
from gateway.task_store_registry import open_task_store
from meshserve.errors import InvalidArgument, ResourceExhausted
from tests.support.redis_server import acl_user

TTL_S = 100.0  # long beside the test's real duration: only the tests' advance() makes it pass


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store_case(request):
    """(store, advance): ``advance(s)`` lets ``s`` seconds pass for the store's TTLs,
    at once: a fake clock in memory; for Redis, whose own clock expires keys, every
    task key's remaining time to live is cut by ``s`` (``PEXPIRE`` with a time <= 0
    deletes the key, as its expiry would)."""
    if request.param == "memory":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        store = MemoryTaskStore(ttl_s=TTL_S, max_tasks=100, clock=clock)
    else:
        store = RedisTaskStore(request.getfixturevalue("redis_url"), ttl_s=TTL_S)
        await store._redis.flushdb()

        async def advance(seconds: float) -> None:
            await advance_redis(store, seconds)

    yield store, advance
    await store.close()


async def advance_redis(store: RedisTaskStore, seconds: float) -> None:
    """Lets ``seconds`` pass for the TTLs of the task keys in ``store``'s Redis, and for
    the expiry times that score the tenants' unfinished sets (the same time, in ms)."""
    async for key in store._redis.scan_iter(match=KEY_PREFIX + "*"):
        left_ms = await store._redis.pttl(key)
        if left_ms >= 0:  # -1: no expiry, -2: already gone
            await store._redis.pexpire(key, left_ms - int(seconds * 1000))
    async for key in store._redis.scan_iter(match=UNFINISHED_PREFIX + "*"):
        for member in await store._redis.zrange(key, 0, -1):
            await store._redis.zincrby(key, -int(seconds * 1000), member)


def record(task_id: str, **fields) -> TaskRecord:
    return TaskRecord(task_id, fields.pop("tenant", "acme"), **fields)


async def test_create_then_get_returns_the_same_record(store_case):
    store, _ = store_case
    rec = TaskRecord("task-1", "acme", request_id="req-1", created_at=12.5, result=b"\x00\xff\x10",
                     traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    await store.create(rec)
    assert await store.get("task-1") == rec
    assert await store.get("task-2") is None
    with pytest.raises(ValueError, match="exists"):
        await store.create(record("task-1"))


async def test_a_create_retried_after_its_first_try_landed_succeeds_and_counts_once(store_case):
    """The Redis client retries a command whose reply was lost with its connection: the
    same record again is no error, the store is unchanged and the tenant's count is 1."""
    store, _ = store_case
    rec = record("task-1", request_id="req-1", created_at=12.5, owner="gw-1", attempt=1, lease_until=99.0)
    await store.create(rec, max_unfinished=1)
    await store.create(rec, max_unfinished=1)
    assert (await store.get("task-1"), await store.unfinished_count("acme")) == (rec, 1)
    with pytest.raises(ValueError, match="task 'task-1' exists"):
        await store.create(record("task-1", request_id="req-2"), max_unfinished=5)


async def test_transitions_are_compare_and_set(store_case):
    store, _ = store_case
    await store.create(record("t"))
    running = await store.transition("t", (TaskState.QUEUED,), TaskState.RUNNING, started_at=5.0)
    assert (running.state, running.started_at, running.finished_at) == (TaskState.RUNNING, 5.0, 0.0)
    assert await store.transition("t", (TaskState.QUEUED,), TaskState.RUNNING, started_at=9.0) is None
    done = await store.transition("t", UNFINISHED, TaskState.SUCCEEDED, finished_at=6.0, result=b"out")
    assert (done.state, done.started_at, done.finished_at, done.result) == (TaskState.SUCCEEDED, 5.0, 6.0, b"out")
    # a cancel arriving after the result changes nothing
    assert await store.transition("t", UNFINISHED, TaskState.CANCELLED, finished_at=7.0) is None
    assert await store.get("t") == done
    assert await store.transition("unknown", UNFINISHED, TaskState.CANCELLED) is None


async def test_a_cancel_before_the_result_wins(store_case):
    store, _ = store_case
    await store.create(record("t"))
    cancelled = await store.transition("t", UNFINISHED, TaskState.CANCELLED, finished_at=3.0)
    assert cancelled.state == TaskState.CANCELLED
    assert await store.transition("t", UNFINISHED, TaskState.FAILED, error_code="UNAVAILABLE") is None
    assert await store.transition("t", UNFINISHED, TaskState.SUCCEEDED, result=b"late") is None
    got = await store.get("t")
    assert (got.state, got.result, got.error_code) == (TaskState.CANCELLED, b"", "")


async def test_finished_tasks_expire_after_the_ttl_unfinished_ones_stay(store_case):
    store, advance = store_case
    for task_id in ("done", "queued", "running"):
        await store.create(record(task_id))
    await store.transition("running", (TaskState.QUEUED,), TaskState.RUNNING, started_at=1.0)
    await store.transition("done", UNFINISHED, TaskState.FAILED, error_code="UNAVAILABLE", error_message="gone")
    await advance(TTL_S / 4)
    assert (await store.get("done")).error_code == "UNAVAILABLE"
    await advance(TTL_S)
    assert await store.get("done") is None
    assert await store.transition("done", UNFINISHED, TaskState.CANCELLED) is None
    assert (await store.get("queued")).state == TaskState.QUEUED
    assert (await store.get("running")).state == TaskState.RUNNING
    # the TTL counts from each task's own final transition
    await store.transition("queued", UNFINISHED, TaskState.SUCCEEDED, result=b"r")
    await advance(TTL_S / 4)
    assert (await store.get("queued")).result == b"r"
    await advance(TTL_S)
    assert await store.get("queued") is None
    assert (await store.get("running")).state == TaskState.RUNNING


async def test_memory_store_drops_oldest_finished_first_and_refuses_when_full_of_unfinished():
    store = MemoryTaskStore(ttl_s=100.0, max_tasks=3, clock=FakeClock())
    for task_id in ("t1", "t2", "t3"):
        await store.create(record(task_id))
    with pytest.raises(ResourceExhausted, match="3 unfinished tasks"):
        await store.create(record("t4"))
    await store.transition("t2", UNFINISHED, TaskState.SUCCEEDED)   # finished first
    await store.transition("t1", UNFINISHED, TaskState.CANCELLED)
    await store.create(record("t4"))
    assert await store.get("t2") is None and (await store.get("t1")).state == TaskState.CANCELLED
    await store.create(record("t5"))
    assert await store.get("t1") is None
    assert [len(store)] == [3]
    with pytest.raises(ResourceExhausted):
        await store.create(record("t6"))
    assert sorted([t for t in ("t3", "t4", "t5") if await store.get(t) is not None]) == ["t3", "t4", "t5"]


def test_redis_encoding_round_trips_every_field():
    rec = TaskRecord("task-x", "globex", "req", TaskState.FAILED, 1.5, 2.5, 3.5, b"\x00\x01\xfe", "INTERNAL",
                     "boom", "00-0000000000000000000000000000abcd-00000000000000ef-01")
    assert decode(encode(rec)) == rec


async def test_open_task_store_by_url(redis_url):
    assert isinstance(open_task_store("memory", 5.0, 7), MemoryTaskStore)
    mem = open_task_store("memory", 5.0, 7)
    assert (mem.ttl_s, mem.max_tasks) == (5.0, 7)
    redis_store = open_task_store(redis_url, 9.0)
    assert isinstance(redis_store, RedisTaskStore) and redis_store.ttl_s == 9.0 and redis_store.shared
    await redis_store.check()
    await redis_store.close()
    for bad in ("postgres://db", "redis", ""):
        with pytest.raises(InvalidArgument, match="--task-store"):
            open_task_store(bad)
    with pytest.raises(InvalidArgument, match="TTL"):
        open_task_store("memory", 0.0)
    with pytest.raises(InvalidArgument, match="max_tasks"):
        open_task_store("memory", 1.0, 0)


async def test_unreachable_redis_fails_the_check():
    from tests.support.redis_server import free_port

    store = RedisTaskStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(ConnectionError, match="cannot be reached"):
        await store.check()
    await store.close()


async def test_the_start_check_refuses_a_redis_user_that_may_not_run_scripts_the_readiness_ping_does_not(redis_url):
    url = acl_user(redis_url, "noscript-start", "s3cret-pw", "+@all", "-@scripting")
    store = RedisTaskStore(url)
    try:
        await store.check()  # a readiness poll: PING only
        with pytest.raises(StoreUnfit) as info:
            await store.check_at_start()
    finally:
        await store.close()
    assert str(info.value) == (f"task store {redis_url.replace('redis://', 'redis://***@')} cannot serve tasks: "
                               "SCRIPT LOAD failed: this user has no permissions to run the 'script|load' command")


async def test_the_start_check_passes_a_redis_that_serves_tasks_and_loads_the_create_script(redis_url):
    store = RedisTaskStore(redis_url)
    try:
        await store._redis.script_flush()
        warning = await store.check_at_start()  # the test Redis keeps no append-only file
        assert await store._redis.script_exists(store._create.sha) == [True]
    finally:
        await store.close()
    assert warning == (f"task store {redis_url}: it runs without its append-only file (appendonly no), so a restart "
                       "of Redis loses the tasks written since its last snapshot (all of them without snapshots); run "
                       "it with --appendonly yes --appendfsync always")


async def test_the_start_check_refuses_a_read_only_replica(redis_url):
    """Found by a review: a replica answers PING, loads the script and says its version,
    then refuses every submit ("You can't write against a read only replica")."""
    from tests.support.redis_server import replica_of

    with replica_of(redis_url) as url:  # redis_url's fixture skips the test without redis-server
        for user in (url, acl_user(url, "app-replica", "s3cret-pw", "+@all", "-@dangerous")):  # INFO, then HELLO
            store = RedisTaskStore(user)
            try:
                with pytest.raises(StoreUnfit) as info:
                    await store.check_at_start()
            finally:
                await store.close()
            assert str(info.value).endswith("cannot serve tasks: this Redis is a read-only replica (role "
                                            f"{'slave' if user == url else 'replica'}): give the task store its "
                                            "primary's URL")


async def test_the_start_check_passes_an_application_user_that_may_not_run_info(redis_url):
    """Found by a review: ``+@all -@dangerous`` (a common application ACL) may not run
    INFO, yet the store works with it: the version comes from HELLO then."""
    url = acl_user(redis_url, "app-start", "s3cret-pw", "+@all", "-@dangerous")
    admin, store = RedisTaskStore(redis_url), RedisTaskStore(url)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store._redis.info("server")
        real = (await admin._redis.info("server"))["redis_version"]
        assert await server_version(store._redis) == real  # from HELLO
        await store.check_at_start()
        await store.create(record("t-app", tenant="app-user"), max_unfinished=1)  # a tenant of its own:
        assert await store.unfinished_count("app-user") == 1  # the module's Redis holds other tests' tasks
    finally:
        await store.close()
        await admin.close()


@pytest.mark.parametrize("version, reason", [
    ("5.0.14", "Redis 5.0.14 is older than 6.2, which the task store needs (SET ... PXAT)"),
    ("6.0.16", "Redis 6.0.16 is older than 6.2, which the task store needs (SET ... PXAT)"),
    ("6.2.0", None), ("6.2.14", None), ("7.0.15", None), ("10.0.0", None),
    (None, None), ("unknown", None)])  # not known: the script load checks what it can
def test_the_start_check_needs_redis_6_2_or_later(version, reason):
    """No Redis older than 6.2 is at hand: the version rule alone (the check's other
    half, the script load, runs against the real server above)."""
    assert version_unfit(version) == reason


async def test_a_pending_callback_is_claimed_renewed_by_its_holder_and_taken_over_after_its_lease(store_case):
    store, _advance = store_case
    await store.create(record("t1", callback_url="https://h.example.com/x", callback_state="pending"))
    await store.create(record("t2"))                                     # no callback: never listed
    assert await store.claimable_callbacks(2000.0) == []                # unfinished: not yet
    for task_id in ("t1", "t2"):
        await store.transition(task_id, UNFINISHED, TaskState.SUCCEEDED, callback_owner="gw-a",
                               callback_lease_until=1010.0)
    assert await store.claimable_callbacks(1005.0) == []                # gw-a's lease is live
    assert await store.claim_callback("t1", "gw-b", 1005.0, 10.0) is None
    renewed = await store.claim_callback("t1", "gw-a", 1005.0, 10.0)    # its holder renews
    assert (renewed.callback_owner, renewed.callback_lease_until) == ("gw-a", 1015.0)
    assert await store.claimable_callbacks(1016.0) == ["t1"]            # lapsed
    taken = await store.claim_callback("t1", "gw-b", 1016.0, 10.0)
    assert (taken.callback_owner, taken.callback_lease_until) == ("gw-b", 1026.0)
    # the old holder's writes are fenced off; the new holder's land and end the listing
    assert await store.transition("t1", FINISHED, None, callback_fence="gw-a", callback_state="failed") is None
    done = await store.transition("t1", FINISHED, None, callback_fence="gw-b", callback_state="delivered",
                                  callback_owner="")
    assert done.callback_state == "delivered"
    assert await store.claimable_callbacks(9999.0) == []
    assert await store.claim_callback("t1", "gw-c", 9999.0, 10.0) is None


def bound_message(count: int, bound: int) -> str:
    return (f"tenant 'acme' has {count} unfinished tasks (queued or running); its bound is {bound} "
            "(max_unfinished_tasks, default --max-unfinished-tasks-per-tenant); submit again once one of them finishes")


async def test_a_tenant_at_its_bound_is_refused_nothing_is_stored_and_other_tenants_are_not(store_case):
    store, _ = store_case
    for task_id in ("a1", "a2"):
        await store.create(record(task_id), max_unfinished=2)
    with pytest.raises(ResourceExhausted) as info:
        await store.create(record("a3"), max_unfinished=2)
    assert (str(info.value), info.value.retry_after_s) == (bound_message(2, 2), 1.0)
    assert await store.get("a3") is None
    await store.create(record("g1", tenant="globex"), max_unfinished=2)
    await store.create(record("a4"))  # no bound given: stored, and counted
    assert [await store.unfinished_count(t) for t in ("acme", "globex", "nobody")] == [3, 1, 0]
    assert sorted(await store.claimable(1e12)) == ["a1", "a2", "a4", "g1"]  # the lease index holds the stored


async def test_a_refusal_states_the_tenants_real_count_when_it_is_above_the_bound(store_case):
    """A bound lowered since the tasks were stored, or gateways sharing a store with
    different bounds: the count the refusal names is the tenant's, not the bound."""
    store, _ = store_case
    for i in range(5):
        await store.create(record(f"t{i}"), max_unfinished=10)
    with pytest.raises(ResourceExhausted) as info:
        await store.create(record("t9"), max_unfinished=2)
    assert str(info.value) == bound_message(5, 2)
    assert (await store.get("t9"), await store.unfinished_count("acme")) == (None, 5)


async def test_every_final_state_frees_a_place_and_running_or_handed_back_tasks_still_count(store_case):
    store, _ = store_case
    for task_id in ("t1", "t2", "t3"):
        await store.create(record(task_id, callback_url="https://h.example.com/x", callback_state="pending"),
                           max_unfinished=3)
    counts = []
    await store.transition("t1", (TaskState.QUEUED,), TaskState.RUNNING, started_at=1.0)
    await store.claim("t2", "gw-b", 1000.0, 10.0)
    await store.transition("t2", UNFINISHED, TaskState.QUEUED, owner="", lease_until=0.0)  # handed back
    counts.append(await store.unfinished_count("acme"))
    with pytest.raises(ResourceExhausted):
        await store.create(record("t4"), max_unfinished=3)
    await store.transition("t1", UNFINISHED, TaskState.SUCCEEDED, result=b"r")
    counts.append(await store.unfinished_count("acme"))
    await store.create(record("t4"), max_unfinished=3)
    counts.append(await store.unfinished_count("acme"))
    await store.transition("t2", UNFINISHED, TaskState.FAILED, error_code="UNAVAILABLE")
    await store.transition("t3", UNFINISHED, TaskState.CANCELLED)
    await store.transition("t1", FINISHED, None, callback_state="delivered")  # a finished record's update
    counts.append(await store.unfinished_count("acme"))
    assert counts == [3, 2, 3, 1]
    for task_id in ("t5", "t6"):
        await store.create(record(task_id), max_unfinished=3)
    assert await store.unfinished_count("acme") == 3


async def test_concurrent_creates_never_pass_the_bound(store_case):
    """On Redis, two store clients on one database: two gateways submitting at once."""
    store, _ = store_case
    stores = [store, RedisTaskStore(store.url, ttl_s=TTL_S)] if isinstance(store, RedisTaskStore) else [store]
    results = await asyncio.gather(*(stores[i % len(stores)].create(record(f"t{i}"), max_unfinished=5)
                                     for i in range(20)), return_exceptions=True)
    for other in stores[1:]:
        await other.close()
    assert [r is None for r in results].count(True) == 5
    assert all(isinstance(r, ResourceExhausted) for r in results if r is not None)
    stored = [i for i in range(20) if await store.get(f"t{i}") is not None]
    assert (len(stored), await store.unfinished_count("acme")) == (5, 5)


async def test_an_unfinished_record_that_expires_stops_counting_with_it(redis_url):
    """A gateway that died between its create and its task's end, with no other gateway
    left to take the task over: the record expires after ``unfinished_ttl_s``, and its
    tenant's count drops with it, not later."""
    store = RedisTaskStore(redis_url, ttl_s=TTL_S, unfinished_ttl_s=10 * TTL_S)
    await store._redis.flushdb()
    try:
        for task_id in ("t1", "t2"):
            await store.create(record(task_id), max_unfinished=2)
        # the member's score is its record's expiry, to the millisecond
        assert await store._redis.zscore(UNFINISHED_PREFIX + "acme", "t1") == await store._redis.pexpiretime(
            KEY_PREFIX + "t1")
        await advance_redis(store, 5 * TTL_S)
        assert await store.unfinished_count("acme") == 2
        with pytest.raises(ResourceExhausted, match="its bound"):
            await store.create(record("t3"), max_unfinished=2)
        await advance_redis(store, 5 * TTL_S)
        assert (await store.get("t1"), await store.unfinished_count("acme")) == (None, 0)
        await store.create(record("t3"), max_unfinished=2)
        assert (await store.unfinished_count("acme"), await store._redis.zcard(UNFINISHED_PREFIX + "acme")) == (1, 1)
        # the set itself expires with its last member
        assert await store._redis.pexpiretime(UNFINISHED_PREFIX + "acme") == await store._redis.pexpiretime(
            KEY_PREFIX + "t3")
    finally:
        await store.close()


@pytest.fixture
async def redis_store(redis_url):
    """A Redis task store on an emptied database."""
    store = RedisTaskStore(redis_url, ttl_s=TTL_S)
    await store._redis.flushdb()
    yield store
    await store.close()


async def end_as_the_previous_version(store: RedisTaskStore, task_id: str, state: TaskState) -> None:
    """A final transition as a gateway of the previous version wrote it (during a rolling
    upgrade): the record, final, with the finished TTL, out of the lease index; its
    tenant's unfinished set left as it was."""
    key = KEY_PREFIX + task_id
    ended = replace(decode(await store._redis.get(key)), state=state, owner="")
    await store._redis.set(key, encode(ended), px=int(TTL_S * 1000))
    await store._redis.zrem(LEASES_KEY, task_id)


async def members(store: RedisTaskStore, tenant: str = "acme") -> list[str]:
    return [m.decode() for m in await store._redis.zrange(UNFINISHED_PREFIX + tenant, 0, -1)]


@pytest.mark.parametrize("state", FINISHED)
async def test_a_task_ended_by_a_gateway_of_the_previous_version_stops_counting_at_the_bound(redis_store, state):
    store = redis_store
    await store.create(record("x1", owner="gw-new", attempt=1, lease_until=1e12), max_unfinished=1)
    await end_as_the_previous_version(store, "x1", state)
    assert await store.unfinished_count("acme") == 1  # its member stays until a submit meets the bound
    await store.create(record("x2"), max_unfinished=1)
    assert (await members(store), await store.unfinished_count("acme")) == (["x2"], 1)
    assert (await store.get("x1")).state == state


async def test_a_record_deleted_or_evicted_stops_counting_at_the_bound(redis_store):
    store = redis_store
    for task_id in ("e1", "e2"):
        await store.create(record(task_id), max_unfinished=2)
    await store._redis.delete(KEY_PREFIX + "e1")  # what an eviction under maxmemory does
    await store.create(record("e3"), max_unfinished=2)
    assert (await members(store), await store.unfinished_count("acme")) == (["e2", "e3"], 2)
    with pytest.raises(ResourceExhausted) as info:
        await store.create(record("e4"), max_unfinished=2)
    assert str(info.value) == bound_message(2, 2)


async def test_the_sweep_at_the_bound_keeps_every_unfinished_record_and_drops_only_stale_ones(redis_store):
    """A short record whose head does not give its state (quotes that mimic the state
    field) is read whole; a long one (a request id escaped past the head) counts until
    it expires, never read whole; running and handed-back tasks keep counting."""
    store = redis_store
    ids = {"q1": "", "q2": "r" * 2000, "q3": '","state":4,"x":"', "q4": "plain", "q5": "then ended"}
    for task_id, request_id in ids.items():
        await store.create(record(task_id, request_id=request_id), max_unfinished=5)
    await store.transition("q1", (TaskState.QUEUED,), TaskState.RUNNING, started_at=1.0)
    await store.claim("q2", "gw-b", 1000.0, 10.0)
    await store.transition("q2", UNFINISHED, TaskState.QUEUED, owner="", lease_until=0.0)  # handed back
    with pytest.raises(ResourceExhausted) as info:
        await store.create(record("q6"), max_unfinished=5)
    assert str(info.value) == bound_message(5, 5)
    assert await members(store) == ["q1", "q2", "q3", "q4", "q5"]
    await store._redis.delete(SWEPT_PREFIX + "acme")  # the sweep interval passed
    await end_as_the_previous_version(store, "q5", TaskState.SUCCEEDED)
    await end_as_the_previous_version(store, "q2", TaskState.FAILED)
    await end_as_the_previous_version(store, "q3", TaskState.CANCELLED)
    await store.create(record("q6"), max_unfinished=5)
    assert await members(store) == ["q1", "q2", "q4", "q6"]  # q2 ended, but its head hides it: counted


async def test_a_tenant_at_its_bound_is_swept_at_most_once_per_interval(redis_store):
    """The sweep reads up to ``bound`` records: refusals in a row within the interval (the
    refusal's Retry-After, 1 s) count without it, and the next one after it sweeps."""
    store = redis_store
    for task_id in ("a1", "a2"):
        await store.create(record(task_id), max_unfinished=2)
    with pytest.raises(ResourceExhausted):
        await store.create(record("a3"), max_unfinished=2)
    assert 0 < await store._redis.pttl(SWEPT_PREFIX + "acme") <= 1000
    await store._redis.delete(KEY_PREFIX + "a1")
    with pytest.raises(ResourceExhausted) as info:
        await store.create(record("a3"), max_unfinished=2)
    assert (str(info.value), await members(store)) == (bound_message(2, 2), ["a1", "a2"])
    await store._redis.delete(SWEPT_PREFIX + "acme")  # as its expiry does after the interval
    await store.create(record("a3"), max_unfinished=2)
    assert await members(store) == ["a2", "a3"]
