"""A gateway stopping (SIGTERM: ``stop_gateway``) with calls still running when its
grace runs out: the gateway ends each one itself, UNAVAILABLE saying why, before its
servers stop; the executor aborts the requests (every block free), the leases are
released, and the gateway logs no traceback."""

import asyncio
import json
import logging

import grpc
import httpx2 as httpx
import pytest

from gateway.request import ModelInfo
from gateway.server import start_gateway, stop_gateway
from gateway.task_api import to_status
from meshserve.client import build_request, channel, generate, get_task, submit_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.engines import make_engine
from tests.support.mesh_harness import StepGate, start_local_mesh, wait_for_condition

pytestmark = pytest.mark.model

PROMPT = [1000 + (i * 7919) % 40000 for i in range(40)]
GRACE_S = 0.5
GRACE_RAN_OUT = ("the gateway is stopping and its grace of 0.5 s ran out before this request finished; "
                 "the request can be retried")
LONG = dict(max_tokens=900, temperature=0.0, ignore_eos=True)  # far past the grace, whatever the host



async def _mesh_with_gateway(tokenizer):
    """A local mesh of one executor (its ``LLMEngine``, the mesh) and a ready gateway on it
    (gRPC and HTTP)."""
    engine = make_engine()
    m = await start_local_mesh([engine], tokenizer)
    info = ModelInfo(engine.model_id, engine.max_model_len, engine.vocab_size, engine.revision)
    gw = await start_gateway(tokenizer, info, m.scheduler.address, 0, tls=m.tls("gateway"), http_port=0)
    await wait_for_condition(lambda: gw.servicer.readiness.ready is True, what="the gateway ready")
    return engine, m, gw

async def test_calls_still_running_when_the_gateway_s_grace_runs_out_end_unavailable_saying_so(tokenizer, caplog):
    """A gRPC stream, an HTTP stream, a non-streamed HTTP request and an async task
    held past the gateway's 0.5 s grace while it stops: the gRPC caller gets UNAVAILABLE with the
    gateway's message (not gRPC's bare "Cancelling all calls"), the HTTP stream an
    error event then ``[DONE]`` on a cleanly closed response (not an incomplete
    chunked read), the plain request 503 with Retry-After, the task its runner's end
    (FAILED UNAVAILABLE with a memory store); the executor aborted all four (every
    block free), no lease is left, and no traceback was logged."""
    caplog.set_level(logging.INFO)
    engine, m, gw = await _mesh_with_gateway(tokenizer)
    async_engine, core = m.executors[0][1], m.scheduler.servicer.core
    try:
        async with channel(gw.address, m.tls("client")) as ch, \
                httpx.AsyncClient(base_url=gw.http.url, timeout=None) as http:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            grpc_tokens: list[int] = []
            grpc_call = asyncio.create_task(generate(stub, build_request(PROMPT, **LONG), timeout=600,
                                                     on_delta=lambda _text, ids: grpc_tokens.extend(ids)))
            stream_lines: list[str] = []
            chat = {"messages": [{"role": "user", "content": "Count to a thousand."}], **LONG}

            async def http_stream():
                async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line:
                            stream_lines.append(line)

            http_call = asyncio.create_task(http_stream())
            plain_call = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Count on.", **LONG}))
            task = await submit_task(stub, build_request(PROMPT[:30], **LONG))
            while (await get_task(stub, task.task_id)).state != gateway_pb2.TASK_STATE_RUNNING:
                await asyncio.sleep(0.01)
            await wait_for_condition(lambda: grpc_tokens and len(stream_lines) > 1
                                     and async_engine.stats().num_running == 4, 120, "all four requests running")
            with StepGate(engine) as gate:
                await gate.hold(after_steps=engine.num_steps + 1)  # all run, and still will after the grace
                caplog.clear()
                await asyncio.wait_for(stop_gateway(gw, GRACE_S), 60)
                with pytest.raises(grpc.aio.AioRpcError) as grpc_error:
                    await asyncio.wait_for(grpc_call, 60)
                await asyncio.wait_for(http_call, 60)
                plain = await asyncio.wait_for(plain_call, 60)
        assert (grpc_error.value.code(), grpc_error.value.details()) == (grpc.StatusCode.UNAVAILABLE, GRACE_RAN_OUT)
        error = {"error": {"message": GRACE_RAN_OUT, "type": "service_unavailable_error", "param": None,
                           "code": "service_unavailable"}}
        assert [json.loads(line[6:]) for line in stream_lines[-2:-1]] == [error]
        assert stream_lines[-1] == "data: [DONE]"
        assert (plain.status_code, plain.json(), plain.headers.get("retry-after")) == (503, error, "1")
        # the task: the task runner's own end (a memory store's task fails UNAVAILABLE; a shared one is handed back)
        status = to_status(await gw.servicer.tasks.runner.store.get(task.task_id))
        assert (status.state, status.error.code) == (gateway_pb2.TASK_STATE_FAILED, "UNAVAILABLE")
        await wait_for_condition(lambda: async_engine.stats().num_running == 0, 60, "the four requests aborted")
        stats = async_engine.stats()
        assert (stats.num_aborted, stats.num_free_blocks) == (4, stats.num_blocks)
        await wait_for_condition(lambda: core.num_leases() == 0 and len(core) == 0, 60, "every lease released")
        logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert not logged, [f"{r.name}: {r.getMessage()}" for r in logged]
        assert not any("timeout graceful shutdown exceeded" in r.getMessage() for r in caplog.records)
    finally:
        await m.stop()


async def test_a_completion_of_several_prompts_ended_at_the_grace_s_end_releases_every_lease_in_full(tokenizer,
                                                                                                    caplog):
    """Three prompts of one HTTP completion (n = 2), each its own guarded stream, held past
    the grace: 503 with the gateway's message, all three aborted, and each lease's release
    completed before the stop went on. The first prompt's error used to cancel the others'
    streams a second time in the middle of their release ('release of lease … failed:
    CancelledError()', the Release left to land after the gateway may close its channel)."""
    caplog.set_level(logging.INFO)
    engine, m, gw = await _mesh_with_gateway(tokenizer)
    async_engine, core = m.executors[0][1], m.scheduler.servicer.core
    try:
        async with httpx.AsyncClient(base_url=gw.http.url, timeout=None) as http:
            call = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": ["Count on.", "Count up.", "Count down."], "n": 2, **LONG}))
            running = 6  # each prompt's n = 2 choices are two engine requests
            await wait_for_condition(lambda: async_engine.stats().num_running == running, 120,
                                     "the six choices running")
            with StepGate(engine) as gate:
                await gate.hold(after_steps=engine.num_steps + 1)
                caplog.clear()
                await asyncio.wait_for(stop_gateway(gw, GRACE_S), 60)
                answer = await asyncio.wait_for(call, 60)
        assert (answer.status_code, answer.json()["error"]["message"]) == (503, GRACE_RAN_OUT)
        await wait_for_condition(lambda: async_engine.stats().num_running == 0, 60, "the three prompts aborted")
        stats = async_engine.stats()
        assert (stats.num_aborted, stats.num_free_blocks) == (running, stats.num_blocks)
        assert core.num_leases() == 0  # released before the stop ended, not after
        failed = [r.getMessage() for r in caplog.records if "release of lease" in r.getMessage()]
        assert not failed
    finally:
        await m.stop()
