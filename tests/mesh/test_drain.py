"""Graceful scale-down through the real mesh: a draining executor finishes its
in-flight request, new requests go to the other executor, no caller sees an error (C42)."""

import asyncio
import json

import grpc
import httpx2 as httpx
import pytest

from executor.drain import DRAINED_MESSAGE, drain
from executor.server import start_executor
from meshserve.client import build_request, channel, generate
from meshserve.sampling import SamplingParams, to_proto
from meshserve.v1 import executor_pb2, executor_pb2_grpc
from tests.support.engines import make_engine
from tests.support.leases import signed_lease
from tests.support.mesh_harness import StepGate, start_local_mesh, wait_for_condition

pytestmark = pytest.mark.model

PROMPT = [1000 + (i * 7919) % 40000 for i in range(40)]
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


async def late_execute(m, request_id: str) -> grpc.aio.AioRpcError:
    """An Execute sent straight to executor 0 with a valid lease of its scheduler (a late
    retry after the drain ended); returns the error it ended with."""
    req = executor_pb2.ExecuteRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                      lease=signed_lease(m, 0, request_id), tenant="default")
    to_proto(SamplingParams(**GREEDY), req.sampling)
    async with channel(m.executors[0][0].address, m.tls("gateway")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [msg async for msg in executor_pb2_grpc.ExecutorStub(ch).Execute(req, timeout=60)]
    return info.value


async def test_draining_executor_finishes_in_flight_work_and_new_requests_go_elsewhere(tokenizer):
    engine_x, engine_y = make_engine(), make_engine()
    m = await start_local_mesh([engine_x], tokenizer)
    svc_x, _, link_x = m.executors[0]
    core = m.scheduler.servicer.core
    try:
        with StepGate(engine_x) as gate:
            held = asyncio.create_task(gate.hold(after_steps=engine_x.num_steps + 1))
            in_flight = asyncio.create_task(generate(m.stub, build_request(PROMPT, **GREEDY), timeout=600))
            await held  # x has run the first step of the request and is held before the next
            svc_y, async_y, link_y = await start_executor(engine_y, 0, scheduler_address=m.scheduler.address,
                                                          executor_id="executor-1", tls=m.tls("executor"))
            m.executors.append((svc_y, async_y, link_y))
            draining = asyncio.create_task(drain(svc_x, svc_x.servicer, link_x, grace_s=600.0))
            await wait_for_condition(link_x.drain_acked.is_set, 60, "drain acknowledged")
            assert core.registry.get("executor-0").draining
            new = await asyncio.gather(*(generate(m.stub, build_request(PROMPT[:30 + i], **GREEDY), timeout=600)
                                         for i in range(3)))
            assert [r.executor_id for r in new] == ["executor-1"] * 3
            assert not draining.done() and not link_x.drained.is_set()  # x still runs its request
            gate.release()
        first = await in_flight
        assert first.executor_id == "executor-0" and len(first.token_ids) == 12
        assert await asyncio.wait_for(draining, 600) is True
        assert link_x.drained.is_set()
        steps = engine_x.num_steps
        late = await late_execute(m, "late")  # x is leaving: refused at once, nothing run
        assert (late.code(), late.details(), engine_x.num_steps) == (grpc.StatusCode.UNAVAILABLE, DRAINED_MESSAGE,
                                                                     steps)
        again = await generate(m.stub, build_request(PROMPT, **GREEDY), timeout=600)
        assert again.executor_id == "executor-1" and again.token_ids == first.token_ids  # same model, greedy
        await svc_x.watchdog.stop()
        await link_x.stop()  # x leaves: nothing it ran was voided
        await wait_for_condition(lambda: core.registry.get("executor-0") is None, 60, "x gone from the registry")
        assert core.num_leases() == 0
    finally:
        await m.stop()


GRACE_S = 0.5
GRACE_RAN_OUT = ("the executor is stopping and its drain grace of 0.5 s ran out before this request finished; "
                 "the request can be retried")


async def test_a_stream_still_running_when_the_drain_grace_runs_out_ends_unavailable_saying_so(tokenizer):
    """An executor stopped (SIGTERM: drain, then its server stops, as ``run_executor``
    does) while a gRPC and an HTTP stream still run past its grace: each caller gets
    UNAVAILABLE (503 in the stream) saying why and that a retry will do, not gRPC's
    bare cancellation; the engine aborted both requests (every block free) and the
    gateway released both leases."""
    engine = make_engine()
    m = await start_local_mesh([engine], tokenizer, http=True)
    svc, async_engine, link = m.executors[0]
    core = m.scheduler.servicer.core
    long = dict(max_tokens=900, temperature=0.0, ignore_eos=True)  # far past the grace, whatever the host
    try:
        async with httpx.AsyncClient(base_url=m.http_url, timeout=None) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            grpc_tokens: list[int] = []
            grpc_call = asyncio.create_task(generate(m.stub, build_request(PROMPT, **long), timeout=600,
                                                     on_delta=lambda _text, ids: grpc_tokens.extend(ids)))
            http_events: list[dict] = []

            async def http_stream():
                body = {"model": model, "messages": [{"role": "user", "content": "Count to a thousand."}],
                        "stream": True, **long}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            http_events.append(json.loads(line[6:]))

            http_call = asyncio.create_task(http_stream())
            await wait_for_condition(lambda: grpc_tokens and len(http_events) > 1, 120, "both calls streaming")
            with StepGate(engine) as gate:
                await gate.hold(after_steps=engine.num_steps + 1)  # both run, and still will after the grace
                await svc.watchdog.stop()  # the executor's stop, as run_executor runs it
                assert await drain(svc, svc.servicer, link, grace_s=GRACE_S) is False
                late = await late_execute(m, "late")  # refused, not run until the server's stop cancels it
                await svc.set_serving(False)
                await link.stop()
                await svc.stop()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(grpc_call, 60)
                await asyncio.wait_for(http_call, 60)
            m.executors.remove((svc, async_engine, link))
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                             f"executor executor-0: {GRACE_RAN_OUT}")
        assert (late.code(), late.details()) == (grpc.StatusCode.UNAVAILABLE, GRACE_RAN_OUT)
        assert http_events[-1] == {"error": {"message": f"executor executor-0: {GRACE_RAN_OUT}",
                                             "type": "service_unavailable_error", "param": None,
                                             "code": "service_unavailable"}}
        await wait_for_condition(lambda: async_engine.stats().num_running == 0, 60, "both requests aborted")
        stats = async_engine.stats()
        assert (stats.num_aborted, stats.num_free_blocks) == (2, stats.num_blocks)
        await wait_for_condition(lambda: core.num_leases() == 0 and len(core) == 0, 60, "both leases released")
        await async_engine.stop()
    finally:
        await m.stop()
