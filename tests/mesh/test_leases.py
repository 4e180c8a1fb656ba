"""An executor runs only what the scheduler signed (case C35's bad leases), and with
``--prefix-cache-scope tenant`` one tenant gets no prefix hit on another's prompt."""

from __future__ import annotations

import re
import time
import uuid

import grpc
import pytest

from gateway.tenants import TenantRegistry
from meshserve.client import build_request, channel, generate
from meshserve.lease_token import LeaseClaims, LeaseSigner, new_nonce
from meshserve.sampling import SamplingParams, to_proto
from meshserve.v1 import executor_pb2, executor_pb2_grpc
from tests.support.engines import make_engine
from tests.support.leases import signed_lease
from tests.support.mesh_harness import start_local_mesh


def execute_request(request_id: str, lease: bytes, tenant: str = "default") -> executor_pb2.ExecuteRequest:
    req = executor_pb2.ExecuteRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8] * 5, lease=lease,
                                      tenant=tenant)
    to_proto(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), req.sampling)
    return req


def claims_for(executor_id: str, request_id: str, tenant: str = "default", ttl_s: float = 60.0) -> LeaseClaims:
    return LeaseClaims(uuid.uuid4().hex, request_id, tenant, executor_id, 1, time.time() + ttl_s, new_nonce())


async def test_execute_refuses_missing_forged_expired_misdirected_and_replayed_leases(mesh):
    """C35: Execute with no lease, a lease signed by another key, an expired lease, a lease
    issued to another executor (or request, or tenant), a used (released) lease:
    PERMISSION_DENIED, the executor's work counters unchanged, no block held."""
    executor_id = mesh.executors[0][0].servicer.executor_id
    foreign = LeaseSigner().sign(claims_for(executor_id, "bad"))
    other_executor = mesh.scheduler.servicer.signer.sign(claims_for("executor-9", "bad"))
    bad = {
        "missing": execute_request("bad", b""),
        "foreign key": execute_request("bad", foreign),
        "expired": execute_request("bad", signed_lease(mesh, 0, "bad", ttl_s=-1.0)),
        "another executor": execute_request("bad", other_executor),
        "another request": execute_request("bad", signed_lease(mesh, 0, "other-id")),
        "another tenant": execute_request("bad", signed_lease(mesh, 0, "bad"), tenant="acme"),
    }
    async with channel(mesh.executors[0][0].address, mesh.tls("gateway")) as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)
        used = execute_request("good", signed_lease(mesh, 0, "good"))
        assert sum([len(m.token_ids) async for m in stub.Execute(used)]) == 2
        await mesh.wait_idle()
        before = await mesh.executor_stats()
        for what, req in list(bad.items()) + [("replayed", used)]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Execute(req)]
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
        after = await mesh.executor_stats()
    assert (after.num_steps, after.num_prompt_tokens, after.num_finished, after.num_aborted) == \
        (before.num_steps, before.num_prompt_tokens, before.num_finished, before.num_aborted)
    assert after.num_free_blocks == after.num_blocks


async def test_with_tenant_scope_tenant_b_gets_no_prefix_hit_on_tenant_a_prompt(tokenizer, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "a"\napi_keys = ["key-a"]\n\n[[tenants]]\nname = "b"\napi_keys = ["key-b"]\n')
    m = await start_local_mesh([make_engine()], tokenizer, tenants=TenantRegistry.from_file(path))
    prompt = [(7 * i) % 900 + 20 for i in range(80)]  # 5 full blocks; 4 reusable (the last token is recomputed)
    try:
        async def cached_tokens(key: str) -> int:
            out = await generate(m.stub, build_request(prompt, max_tokens=1, temperature=0.0),
                                 metadata=(("x-api-key", key),))
            return out.usage["cached_tokens"]

        assert await cached_tokens("key-a") == 0
        assert await cached_tokens("key-b") == 0   # A's blocks are cached, but not for B
        assert await cached_tokens("key-a") == 64  # A's own repeat hits its 4 blocks
        assert await cached_tokens("key-b") == 64  # and B now hits its own
    finally:
        await m.stop()


async def test_an_execute_that_comes_before_the_register_ack_waits_for_the_key():
    """The scheduler routes to an executor once it registered it; the RegisterAck with
    the lease key may still be on its way on the Connect stream (seen on a loaded host):
    an Execute that comes first waits for the key instead of being refused
    PERMISSION_DENIED, then runs."""
    import asyncio

    from executor.server import start_executor

    svc, async_engine, _ = await start_executor(make_engine(num_blocks=32), 0)  # no scheduler: no key yet
    try:
        signer = LeaseSigner()
        req = execute_request("early", signer.sign(claims_for(svc.servicer.executor_id, "early")))
        async with channel(svc.address) as ch:
            call = asyncio.create_task(_tokens(executor_pb2_grpc.ExecutorStub(ch).Execute(req)))
            await asyncio.sleep(0.3)
            assert not call.done() and not svc.servicer.leases.has_public_key  # waiting, not refused
            svc.servicer.leases.set_public_key(signer.public_key)  # as SchedulerLink._take_lease_key does
            assert await asyncio.wait_for(call, 120) == 2
    finally:
        await svc.watchdog.stop()
        await svc.stop(0.2)
        await async_engine.stop()


async def _tokens(call) -> int:
    return sum([len(m.token_ids) async for m in call])


async def test_a_lease_refused_as_expired_is_unavailable_to_callers_and_tasks_and_leaks_nothing(tokenizer):
    """An executor that refuses the lease (here every lease has expired on its way: the
    scheduler stamps them with a clock 60 s behind, as a loaded host's delay would) is
    the mesh's failure, not the caller's: Generate answers UNAVAILABLE naming the
    executor's reason, never PERMISSION_DENIED; a task is retried under new leases and
    fails UNAVAILABLE after its attempts; no block, lease or queued request is left."""
    from meshserve.client import submit_task, wait_task
    from meshserve.v1 import gateway_pb2

    m = await start_local_mesh([make_engine(num_blocks=32)], tokenizer)
    try:
        m.scheduler.servicer.wall_clock = lambda: time.time() - 60.0
        request = build_request([5, 6, 7, 8] * 5, max_tokens=2, temperature=0.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(m.stub, request)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("executor executor-0 refused the call (PERMISSION_DENIED): lease ")
        ago = re.search(r"expired ([0-9.]+) s ago$", info.value.details())
        assert ago and 50.0 <= float(ago.group(1)) < 60.0  # the lease's 10 s, 60 s behind
        status = await wait_task(m.stub, (await submit_task(m.stub, request)).task_id, poll_s=0.05, timeout_s=120)
        assert (status.state, status.attempt, status.error.code) == (gateway_pb2.TASK_STATE_FAILED, 3, "UNAVAILABLE")
        assert "refused the call (PERMISSION_DENIED)" in status.error.message
        await m.wait_released()
        stats = m.executors[0][1].stats()
        assert (stats.num_steps, stats.num_prompt_tokens, stats.num_free_blocks) == (0, 0, 32)
    finally:
        await m.stop()
