"""Durable tasks across gateway processes on the shared mesh, with a real redis-server:
a gateway process SIGKILLed or SIGTERMed while it holds 8 tasks leaves them to a
live gateway sharing the task store, which finishes each exactly once with the
tokens of a cold run; a callback through a real task, and a callback whose gateway
is SIGKILLed mid-POST delivered once more by the surviving gateway.

The gateways are separate processes (``meshserve gateway``) dialling the shared
in-process mesh's scheduler; the engine is held (``StepGate``) while a gateway
dies, so its tasks are certainly unfinished then. Figures printed (not asserted):
the time from the kill to the last task taken over and finished."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import pytest
import pytest_asyncio

from gateway.callbacks import verify
from meshserve.client import build_request, generate, get_task, submit_task, wait_task
from meshserve.v1 import gateway_pb2
from tests.support.gateway_process import GatewayProcess
from tests.support.http_receiver import Receiver
from tests.support.mesh_harness import StepGate, wait_for_condition
from tests.support.redis_server import redis_url_or_skip

pytestmark = pytest.mark.model

LEASE_S = 2.0
SECRET = b"durable-test-secret"


@pytest.fixture(scope="module")
def redis_url():
    yield from redis_url_or_skip()


@pytest_asyncio.fixture(scope="module")
async def receiver():
    r = await Receiver().start()
    yield r
    await r.stop()


@pytest_asyncio.fixture(scope="module")
async def survivor(mesh, redis_url, tmp_path_factory, receiver):
    """The gateway that stays up (callbacks allowed to the test receiver)."""
    secret = tmp_path_factory.mktemp("secret") / "callback.key"
    secret.write_bytes(SECRET)
    gw = GatewayProcess(mesh.scheduler.address, redis_url, tmp_path_factory.mktemp("logs") / "survivor.log",
                        ("--callback-allow", receiver.url + "/hooks/", "--callback-secret-file", str(secret)))
    yield await gw.ready()
    await gw.stop()


def requests() -> list[gateway_pb2.GenerateRequest]:
    return [build_request(f"Task {i}: list three animals.", max_tokens=8, temperature=0, ignore_eos=True)
            for i in range(8)]


async def hand_over(mesh, doomed: GatewayProcess, end) -> tuple[list[gateway_pb2.TaskHandle], float]:
    """Submits 8 tasks to ``doomed`` while the engine is held, ends it with ``end(proc)``
    (and waits for it to exit), then lets the engine go. Returns the handles and the
    time the gateway was ended (``time.monotonic()``)."""
    engine = mesh.engines[0]
    with StepGate(engine) as gate:
        holding = asyncio.create_task(gate.hold(after_steps=engine.num_steps))
        handles = [await submit_task(doomed.stub, r) for r in requests()]
        await holding                                   # the engine waits before it runs any of them
        end(doomed.proc)
        ended = time.monotonic()
        await asyncio.to_thread(doomed.proc.wait, 120)
    return handles, ended


async def finish_on(survivor: GatewayProcess, handles, refs, ended: float, what: str) -> None:
    statuses = [await wait_task(survivor.stub, h.task_id, poll_s=0.05, timeout_s=600) for h in handles]
    print(f"\n{what}: 8 tasks taken over and finished {time.monotonic() - ended:.2f} s after the gateway ended "
          f"(lease {LEASE_S} s)")
    for handle, status, ref in zip(handles, statuses, refs):
        assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED, status
        assert status.attempt == 2 and len(status.choices) == 1
        (choice,) = status.choices
        assert list(choice.token_ids) == ref.token_ids and choice.text == ref.text
        assert choice.result.request_id == f"{handle.task_id}.attempt2"


async def test_a_sigkilled_gateways_tasks_finish_once_on_another_gateway(mesh, survivor, redis_url, tmp_path):
    refs = [await generate(mesh.stub, r) for r in requests()]  # cold runs through the mesh's own gateway
    doomed = await GatewayProcess(mesh.scheduler.address, redis_url, tmp_path / "killed.log").ready()
    try:
        handles, ended = await hand_over(mesh, doomed, lambda proc: proc.send_signal(signal.SIGKILL))
        await finish_on(survivor, handles, refs, ended, "SIGKILL")
    finally:
        await doomed.stop()
    # the killed gateway never released its scheduler leases: they expire (lease_ttl_s after the
    # last renewal, once the executor no longer lists them), so the shared mesh's later tests start clean
    core = mesh.scheduler.servicer.core
    await wait_for_condition(lambda: core.num_leases() == 0, timeout_s=120, what="the killed gateway's leases")
    await mesh.wait_idle()


async def test_a_sigtermed_gateway_hands_its_tasks_over(mesh, survivor, redis_url, tmp_path):
    refs = [await generate(mesh.stub, r) for r in requests()]
    # its drain lets running tasks finish for --drain-grace-s; the engine is held through it, so
    # after 1 s the gateway hands them back
    doomed = await GatewayProcess(mesh.scheduler.address, redis_url, tmp_path / "stopped.log",
                                  ("--drain-grace-s", "1")).ready()
    try:
        handles, ended = await hand_over(mesh, doomed, lambda proc: proc.send_signal(signal.SIGTERM))
        assert doomed.proc.returncode == 0
        await finish_on(survivor, handles, refs, ended, "SIGTERM")
    finally:
        await doomed.stop()
    core = mesh.scheduler.servicer.core  # the stopping gateway's leases are released (or expire)
    await wait_for_condition(lambda: core.num_leases() == 0, timeout_s=120, what="the stopped gateway's leases")
    await mesh.wait_idle()


async def test_a_task_callback_is_delivered_once_signed(mesh, survivor, receiver):
    receiver.received.clear()
    req = build_request("Say hello.", max_tokens=4, temperature=0, ignore_eos=True)
    req.callback_url = receiver.url + "/hooks/done"
    handle = await submit_task(survivor.stub, req)
    status = await wait_task(survivor.stub, handle.task_id, poll_s=0.05, timeout_s=300)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED
    await wait_for_condition(lambda: len(receiver.received) >= 1, what="the callback")
    final = await get_task(survivor.stub, handle.task_id)
    while final.callback.state == gateway_pb2.CALLBACK_STATE_PENDING:  # its record is written after the POST
        await asyncio.sleep(0.01)
        final = await get_task(survivor.stub, handle.task_id)
    (got,) = receiver.received
    assert got.path == "/hooks/done" and got.headers["x-meshserve-task-id"] == handle.task_id
    assert verify(SECRET, got.headers["x-meshserve-timestamp"], got.body, got.headers["x-meshserve-signature"])
    body = json.loads(got.body)
    assert (body["taskId"], body["state"], body["tenant"]) == (handle.task_id, "TASK_STATE_SUCCEEDED", "default")
    assert body["choices"][0]["tokenIds"] == list(status.choices[0].token_ids)
    assert (final.callback.state, final.callback.attempts, final.callback.url) == (
        gateway_pb2.CALLBACK_STATE_DELIVERED, 1, req.callback_url)


async def test_a_callback_whose_gateway_is_killed_mid_post_is_delivered_once_more_by_another(
        mesh, survivor, receiver, redis_url, tmp_path):
    """The gateway POSTing a task's callback is SIGKILLed while the receiver holds its
    POST unanswered: once its delivery lease lapses the surviving gateway takes the
    pending delivery over and POSTs it once more (same body, valid signature); the
    receiver, deduplicating by task id, sees one delivery; nothing is left to send."""
    secret = tmp_path / "callback.key"
    secret.write_bytes(SECRET)
    receiver.received.clear()
    receiver.hold, receiver.held, receiver.release = 1, asyncio.Event(), asyncio.Event()
    doomed = await GatewayProcess(mesh.scheduler.address, redis_url, tmp_path / "killed-callback.log",
                                  ("--callback-allow", receiver.url + "/hooks/", "--callback-secret-file",
                                   str(secret))).ready()
    try:
        req = build_request("Say hello.", max_tokens=4, temperature=0, ignore_eos=True)
        req.callback_url = receiver.url + "/hooks/killed"
        handle = await submit_task(doomed.stub, req)
        await asyncio.wait_for(receiver.held.wait(), 300)     # its POST is at the receiver, unanswered
        doomed.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.to_thread(doomed.proc.wait, 60)
        receiver.release.set()
        status = await get_task(survivor.stub, handle.task_id)
        assert (status.state, status.callback.state) == (gateway_pb2.TASK_STATE_SUCCEEDED,
                                                         gateway_pb2.CALLBACK_STATE_PENDING)
        for _ in range(60_000):                               # a hang bound, not a speed check
            status = await get_task(survivor.stub, handle.task_id)
            if status.callback.state != gateway_pb2.CALLBACK_STATE_PENDING:
                break
            await asyncio.sleep(0.01)
        print(f"\ncallback taken over and delivered {time.monotonic() - killed:.2f} s after the kill "
              f"(lease {LEASE_S} s)")
    finally:
        await doomed.stop()
    assert (status.callback.state, status.callback.attempts, status.callback.error) == (
        gateway_pb2.CALLBACK_STATE_DELIVERED, 1, "")
    first, second = receiver.received                         # the held POST and exactly one more
    assert first.body == second.body and first.path == second.path == "/hooks/killed"
    for got in (first, second):
        assert got.headers["x-meshserve-task-id"] == handle.task_id
        assert verify(SECRET, got.headers["x-meshserve-timestamp"], got.body, got.headers["x-meshserve-signature"])
    body = json.loads(second.body)
    assert (body["taskId"], body["state"], "callback" in body) == (handle.task_id, "TASK_STATE_SUCCEEDED", False)
    assert body["choices"][0]["tokenIds"] == list(status.choices[0].token_ids)
    import redis.asyncio as aioredis

    from gateway.redis_task_store import CALLBACKS_KEY
    r = aioredis.from_url(redis_url)
    try:
        assert await r.zscore(CALLBACKS_KEY, handle.task_id) is None  # no gateway will send it again
    finally:
        await r.aclose()


async def test_a_callback_outside_the_allow_list_is_refused_and_no_task_is_made(mesh, survivor, receiver, redis_url):
    """C36 (over gRPC): refused naming callback_url; no task record is created."""
    redis_before = await task_keys(redis_url)
    for url in (receiver.url + "/elsewhere", "http://169.254.169.254/latest", "file:///etc/passwd"):
        req = build_request("Say hello.", max_tokens=4, temperature=0)
        req.callback_url = url
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit_task(survivor.stub, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("callback_url")
    assert await task_keys(redis_url) == redis_before


async def task_keys(redis_url: str) -> set[bytes]:
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    try:
        return set(await r.keys("meshserve:task:*"))
    finally:
        await r.aclose()


@pytest_asyncio.fixture(scope="module")
async def two_executors(tokenizer):
    """A mesh of its own with two executors (one is killed)."""
    from tests.support.engines import make_engine
    from tests.support.mesh_harness import start_local_mesh

    m = await start_local_mesh([make_engine(), make_engine()], tokenizer)
    yield m
    await m.stop()


async def test_a_task_whose_executor_is_killed_succeeds_on_the_other(two_executors):
    """The executor running a task goes away mid-task (its server stops, its link to the
    scheduler closes): the task runs again on the other executor, and its output equals
    a cold run's."""
    m = two_executors
    req = build_request("Explain why the sky is blue.", max_tokens=12, temperature=0, ignore_eos=True)
    ref = await generate(m.stub, req)
    engines = m.engines
    gates = [StepGate(e) for e in engines]
    for g in gates:
        g.__enter__()
    try:
        holds = [asyncio.create_task(g.hold(after_steps=e.num_steps + 1)) for g, e in zip(gates, engines)]
        handle = await submit_task(m.stub, req)
        done, _ = await asyncio.wait(holds, return_when=asyncio.FIRST_COMPLETED)
        victim = holds.index(done.pop())                 # held after its first step of the task
        for h in holds:
            h.cancel()
        gates[1 - victim].release()                      # the other engine runs freely
        svc, eng, link = m.executors[victim]
        await link.stop()                                # the executor goes away mid-task: the scheduler
        await svc.watchdog.stop()                        # forgets it, its server stops (its handler ends
        stopping = asyncio.create_task(svc.stop(0))      # once the held engine runs again)
        for _ in range(60_000):                          # a hang bound: the gateway saw the call fail
            if (await get_task(m.stub, handle.task_id)).attempt >= 2:
                break
            await asyncio.sleep(0.01)
        gates[victim].release()
        await stopping
        status = await wait_task(m.stub, handle.task_id, poll_s=0.05, timeout_s=600)
    finally:
        for g in gates:
            g.__exit__(None, None, None)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED, status
    (choice,) = status.choices
    assert list(choice.token_ids) == ref.token_ids and choice.text == ref.text
    assert status.attempt == 2 and status.last_error.startswith("attempt 1: ")
    assert choice.result.executor_id == f"executor-{1 - victim}"
    await eng.stop()
    m.executors.pop(victim)
