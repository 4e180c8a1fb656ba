"""C39 on the shared mesh: a gateway process whose task store and result cache are
one real redis-server (append-only with an fsync per write, as deployments must
run it) that is restarted 3 times within 3 s, has its client connections
killed, and then stops answering (its port blocked).

Scaled down (the property is the same): the port is blocked for
``BLOCK_S`` = 3 task leases (6 s; longer if the checks made during it take
longer) instead of 20 s. What 20 s exercises is a block
longer than the gateway's task lease (its leases lapse, so the tasks it holds
must be re-claimed without a second result), longer than its probe's detection
(0.5 s polls) and longer than one Redis call's bounds; 6 s with a 2 s lease does
all three. "Blocked" is SIGSTOP: connections are accepted and never answered,
the harder case for timeouts (a dropped SYN fails the connect sooner).

The bounds of the case are asserted as deadlines on the calls themselves: a
SubmitTask sent with a 5 s deadline ends UNAVAILABLE (a slower answer would be
DEADLINE_EXCEEDED); the HTTP submit's client timeout is 5 s.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx2 as httpx
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.task_readiness import TASKS_HEALTH_SERVICE
from meshserve.client import build_request, generate, submit_task, wait_task
from meshserve.v1 import gateway_pb2
from tests.support.gateway_process import GatewayProcess
from tests.support.mesh_harness import StepGate, wait_for_condition
from tests.support.redis_server import free_port, redis_process

pytestmark = pytest.mark.model

LEASE_S = 2.0
BLOCK_S = 3 * LEASE_S


def task_request(i: int) -> gateway_pb2.GenerateRequest:
    return build_request(f"Task {i}: name two colours.", max_tokens=6, temperature=0, ignore_eos=True)


async def tasks_health(gw: GatewayProcess) -> int:
    stub = health_pb2_grpc.HealthStub(gw.channel)
    try:
        return (await stub.Check(health_pb2.HealthCheckRequest(service=TASKS_HEALTH_SERVICE), timeout=2)).status
    except grpc.aio.AioRpcError:
        return -1


async def wait_health(gw: GatewayProcess, status: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while (await tasks_health(gw)) != status:
        assert time.monotonic() < deadline, f"the task path not {what} within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_redis_restarts_and_a_blocked_port_lose_no_task_and_keep_generate_serving(mesh, tmp_path):
    """C39."""
    try:
        redis_cm = redis_process(persist_dir=str(tmp_path))
        redis = redis_cm.__enter__()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    http_port = free_port()
    gw = await GatewayProcess(mesh.scheduler.address, redis.url, tmp_path / "gateway.log", lease_s=LEASE_S,
                              extra=("--result-cache", redis.url, "--http-port", str(http_port))).ready()
    inspect = None
    try:
        refs = {i: await generate(mesh.stub, task_request(i)) for i in range(8)}
        sync_req = build_request("Say one word.", max_tokens=4, temperature=0, ignore_eos=True)
        sync_ref = await generate(mesh.stub, sync_req)
        assert (await generate(gw.stub, sync_req)).cached is False          # computed, now in the cache
        assert (await generate(gw.stub, sync_req)).cached is True
        await wait_health(gw, health_pb2.HealthCheckResponse.SERVING, 30, "serving at start")

        # tasks queued before: the engine is held, so they are unfinished while Redis restarts
        engine = mesh.engines[0]
        with StepGate(engine) as gate:
            holding = asyncio.create_task(gate.hold(after_steps=engine.num_steps))
            before = [(await submit_task(gw.stub, task_request(i))).task_id for i in range(4)]
            await holding
            started = time.monotonic()
            for _ in range(3):                                  # 3 restarts (SIGKILL and start) ...
                await asyncio.to_thread(redis.restart)
            restarts_s = time.monotonic() - started
            inspect = aioredis.from_url(redis.url)
            assert sorted(k.decode() for k in await inspect.keys("meshserve:task:*")) == sorted(
                f"meshserve:task:{t}" for t in before)          # ... and every acknowledged task is still there
            await inspect.client_kill_filter(_type="normal", skipme=True)  # every client connection dropped
        # the case's setting is 3 restarts within 3 s: printed, not asserted (not a property of the gateway,
        # and a loaded host restarts a redis-server more slowly)
        print(f"\n3 Redis restarts took {restarts_s:.2f} s")

        redis.pause()                                           # the port blocked
        blocked_at = time.monotonic()
        try:
            # a hang bound: the probe's bound on a ping is tested in tests/gateway/test_redis_outage.py;
            # the block lasts until the checks below are done, however long this took
            await wait_health(gw, health_pb2.HealthCheckResponse.NOT_SERVING, 60, "NOT_SERVING")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await submit_task(gw.stub, task_request(99), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=5) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                r = await http.post("/v1/tasks", json={"model": model, "prompt": "Hi.", "max_tokens": 4})
                assert (r.status_code, r.headers.get("retry-after")) == (503, "1")
                assert (await http.get("/ready/tasks")).status_code == 503
            during = await generate(gw.stub, sync_req, timeout=30)   # synchronous Generate serves, uncached
            assert (during.token_ids, during.cached) == (sync_ref.token_ids, False)
            # the block lasts BLOCK_S at least (the setting; longer when the checks above took longer)
            await asyncio.sleep(max(0.0, BLOCK_S - (time.monotonic() - blocked_at)))
        finally:
            redis.resume()
        resumed_at = time.monotonic()

        # the case's bound after recovery: SERVING again within 10 s
        await wait_health(gw, health_pb2.HealthCheckResponse.SERVING, 10, "SERVING again")
        print(f"task path SERVING {time.monotonic() - resumed_at:.2f} s after Redis answered again")
        after = [(await submit_task(gw.stub, task_request(i))).task_id for i in range(4, 8)]
        statuses = {t: await wait_task(gw.stub, t, poll_s=0.05, timeout_s=300) for t in before + after}
        for i, task_id in enumerate(before + after):
            status = statuses[task_id]
            assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED, status
            (choice,) = status.choices                           # one result, whoever ran it
            assert list(choice.token_ids) == refs[i].token_ids
        keys = sorted(k.decode() for k in await inspect.keys("meshserve:task:*"))
        assert keys == sorted(f"meshserve:task:{t}" for t in before + after)  # none lost, none extra
        assert await inspect.zcard("meshserve:tasks:leases") == 0            # nothing left to claim
        for _ in range(100):                                     # the cache resumes (its bypass window ends)
            again = await generate(gw.stub, sync_req)
            if again.cached:
                break
            await asyncio.sleep(0.1)
        assert (again.cached, again.token_ids) == (True, sync_ref.token_ids)
    finally:
        if inspect is not None:
            await inspect.aclose()
        await gw.stop()
        redis_cm.__exit__(None, None, None)
    core = mesh.scheduler.servicer.core
    await wait_for_condition(lambda: core.num_leases() == 0, timeout_s=120, what="the gateway's leases")
    await mesh.wait_idle()
