"""A tenant's bound on its unfinished async tasks, through the gateway's gRPC and HTTP
faces, on both task stores: a SubmitTask over it is RESOURCE_EXHAUSTED (HTTP 429,
OpenAI's rate-limit body, ``Retry-After``) naming the bound, stores nothing, and
leaves other tenants alone. The gateway's scheduler is unreachable (no model runs);
the tasks that fill a tenant's bound are written into the store directly, held by a
gateway elsewhere with a live lease, so they stay unfinished until the test ends one.
(The stores' exact counts, concurrency and expiry: tests/gateway/test_task_store.py.)"""

from __future__ import annotations

import time

import grpc
import pytest
import pytest_asyncio

from gateway.redis_task_store import KEY_PREFIX, RedisTaskStore
from gateway.task_runner import TaskRunner
from gateway.task_store import UNFINISHED, MemoryTaskStore, TaskRecord, TaskState
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, channel, submit_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.served_gateway import served_gateway

TENANTS = """
[[tenants]]
name = "a"
api_keys = ["key-a"]
max_unfinished_tasks = 2

[[tenants]]
name = "b"
api_keys = ["key-b"]

[[tenants]]
name = "c"
api_keys = ["key-c"]
"""
DEFAULT_BOUND = 3  # the gateway's --max-unfinished-tasks-per-tenant here: tenants b and c
BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


def bound_message(tenant: str, count: int, bound: int) -> str:
    return (f"tenant {tenant!r} has {count} unfinished tasks (queued or running); its bound is {bound} "
            "(max_unfinished_tasks, default --max-unfinished-tasks-per-tenant); submit again once one of them finishes")


@pytest_asyncio.fixture(params=["memory", "redis"])
async def served(request, tmp_path):
    """(http client, gRPC stub, store) of a gateway over a memory or a Redis task store."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    if request.param == "memory":
        store = MemoryTaskStore()
    else:
        store = RedisTaskStore(request.getfixturevalue("redis_url"))
        await store._redis.flushdb()
    runner = TaskRunner(store, max_unfinished_per_tenant=DEFAULT_BOUND)
    async with served_gateway(tenants=TenantRegistry.from_file(path), tasks=runner) as (client, svc):
        ch = channel(svc.address)
        yield client, gateway_pb2_grpc.GatewayStub(ch), store
        await ch.close()


async def seed(store, tenant: str, count: int) -> list[str]:
    """``count`` QUEUED tasks of ``tenant`` held by another gateway (a live lease: not taken over)."""
    ids = [f"task-seed-{tenant}-{i}" for i in range(count)]
    for task_id in ids:
        await store.create(TaskRecord(task_id, tenant, owner="gateway-elsewhere", attempt=1,
                                      lease_until=time.time() + 3600))
    return ids


async def records(store) -> int:
    """How many task records the store holds."""
    if isinstance(store, MemoryTaskStore):
        return len(store)
    return len([key async for key in store._redis.scan_iter(match=KEY_PREFIX + "*")])


def request() -> gateway_pb2.GenerateRequest:
    return build_request("Hello", max_tokens=4, temperature=0)


async def test_a_submit_over_the_tenants_bound_is_resource_exhausted_over_grpc_and_stores_nothing(served):
    _, stub, store = served
    seeded = await seed(store, "a", 2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit_task(stub, request(), (("x-api-key", "key-a"),))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, bound_message("a", 2, 2))
    assert dict(info.value.trailing_metadata())["retry-after-s"] == "1.000"
    assert (await records(store), await store.unfinished_count("a")) == (2, 2)
    # another tenant is served meanwhile
    other = await submit_task(stub, request(), (("x-api-key", "key-b"),))
    assert other.state == gateway_pb2.TASK_STATE_QUEUED and await records(store) == 3
    # one of a's tasks ends: a place is free again
    await store.transition(seeded[0], UNFINISHED, TaskState.CANCELLED)
    handle = await submit_task(stub, request(), (("x-api-key", "key-a"),))
    assert handle.state == gateway_pb2.TASK_STATE_QUEUED and await records(store) == 4


async def test_a_submit_over_the_bound_is_a_429_with_retry_after_over_http(served):
    client, _, store = served
    await seed(store, "a", 2)
    resp = await client.post("/v1/tasks", json=BODY, headers={"authorization": "Bearer key-a"})
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "1")
    assert resp.json() == {"error": {"message": bound_message("a", 2, 2), "type": "rate_limit_error", "param": None,
                                     "code": "rate_limit_exceeded"}}
    assert (await records(store), await store.unfinished_count("a")) == (2, 2)
    resp = await client.post("/v1/tasks", json=BODY, headers={"authorization": "Bearer key-b"})
    assert (resp.status_code, resp.json()["state"]) == (202, "TASK_STATE_QUEUED")


async def test_a_tenant_without_a_bound_of_its_own_gets_the_gateways_default(served):
    client, stub, store = served
    await seed(store, "c", DEFAULT_BOUND)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit_task(stub, request(), (("x-api-key", "key-c"),))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                         bound_message("c", DEFAULT_BOUND, DEFAULT_BOUND))
    resp = await client.post("/v1/tasks", json=BODY, headers={"x-api-key": "key-c"})
    assert resp.status_code == 429
    assert resp.json()["error"]["message"] == bound_message("c", DEFAULT_BOUND, DEFAULT_BOUND)
    assert (await records(store), await store.unfinished_count("c")) == (DEFAULT_BOUND, DEFAULT_BOUND)
