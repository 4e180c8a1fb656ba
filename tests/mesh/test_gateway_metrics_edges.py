"""Gateway request metrics at the edges: every authenticated request is observed
exactly once (e2e and outcome; TTFT once when it streamed a token) and the running
gauge returns to 0 — a duplicate request id (ALREADY_EXISTS), an invalid request,
a stream the caller cancels mid-way, a task that is cancelled, one refused at submit, and a result-cache hit."""

import asyncio

import grpc
import pytest

from gateway.result_cache import ResultCache
from gateway.request import ModelInfo
from gateway.server import start_gateway
from meshserve.client import build_request, cancel_task, channel, generate, get_task, submit_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model
LABELS = {"tenant": "default", "priority": "0"}
GREEDY = dict(temperature=0, ignore_eos=True)


async def _first_delta(call) -> None:
    while (await call.read()).WhichOneof("kind") != "delta":
        pass


async def test_every_request_is_observed_once_and_running_returns_to_zero(tokenizer):
    m = await start_local_mesh([make_engine()], tokenizer)
    e0 = m.engines[0]
    svc = await start_gateway(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision),
                              m.scheduler.address, 0, result_cache=ResultCache(64, ttl_s=600.0),
                              tls=m.tls("gateway"))
    ch = channel(svc.address, m.tls("client"))
    gw = gateway_pb2_grpc.GatewayStub(ch)
    registry = svc.servicer.core.metrics.registry

    def get(name: str, **extra) -> float:
        return registry.get_sample_value(name, {**LABELS, **extra}) or 0.0

    try:
        # 1. a stream the caller cancels after its first token, while a duplicate id is refused
        long = gw.Generate(build_request("Once upon a time", max_tokens=900, request_id="dup", **GREEDY))
        await _first_delta(long)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(gw, build_request("Hello", max_tokens=3, request_id="dup", **GREEDY))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        long.cancel()
        # 2. an invalid request
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(gw, build_request(list(range(1, 1100)), max_tokens=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # 3. an ok request, then the same again: a result-cache hit
        req = build_request("The sky is", max_tokens=4, **GREEDY)
        first = await generate(gw, req)
        hit = await generate(gw, req)
        assert (first.cached, hit.cached, hit.token_ids) == (False, True, first.token_ids)
        # 4. a task cancelled while running, a task refused at submit (its id is in use), a task that fails
        task = await submit_task(gw, build_request("Tell me a story", max_tokens=900, request_id="t-long",
                                                   **GREEDY))
        while get("meshserve_request_ttft_seconds_count") < 4:  # the task streamed its first token
            await asyncio.sleep(0.01)
        assert (await get_task(gw, task.task_id)).state == gateway_pb2.TASK_STATE_RUNNING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await submit_task(gw, build_request("Hi", max_tokens=2, request_id="t-long", **GREEDY))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (await cancel_task(gw, task.task_id)).state == gateway_pb2.TASK_STATE_CANCELLED

        await m.wait_idle()
        deadline = asyncio.get_running_loop().time() + 120  # only bounds a hang
        while get("meshserve_gateway_requests_running") != 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        outcomes = {o: get("meshserve_requests_total", outcome=o)
                    for o in ("ok", "cancelled", "already_exists", "invalid_argument")}
        assert outcomes == {"ok": 2, "cancelled": 2, "already_exists": 2, "invalid_argument": 1}
        assert get("meshserve_request_e2e_seconds_count") == 7
        # TTFT: the cancelled stream, the ok request, the hit, the cancelled task
        assert get("meshserve_request_ttft_seconds_count") == 4
        assert get("meshserve_request_queue_seconds_count") == 3  # stream, ok request, task (not the hit)
        assert get("meshserve_gateway_requests_running") == 0
    finally:
        await ch.close()
        await svc.stop(0.5)
        await svc.servicer.close()
        await m.stop()
