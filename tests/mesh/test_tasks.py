"""Async tasks and the result cache on the shared mesh: a task's tokens equal
Generate's for the same greedy request; result-cache hits return the same tokens
without running the executor (for Generate and tasks, greedy and seeded; never
for unseeded sampling); cancelling a running task aborts its executor call and
frees every KV block and lease.

A second gateway on the shared mesh's scheduler has the result cache on (the
mesh's own gateway has it off, as by default)."""

import asyncio

import pytest
import pytest_asyncio

from gateway.result_cache import ResultCache
from gateway.request import ModelInfo
from gateway.server import start_gateway
from meshserve.client import (build_request, cancel_task, channel, generate, get_task, submit_task,
                              task_completions, wait_task)
from meshserve.telemetry import memory_exporter
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.model


@pytest_asyncio.fixture(scope="module")
async def cached_gateway(mesh, tokenizer):
    e0 = mesh.engines[0]
    svc = await start_gateway(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision),
                              mesh.scheduler.address, 0, result_cache=ResultCache(64, ttl_s=600.0),
                              tls=mesh.tls("gateway"))
    ch = channel(svc.address, mesh.tls("client"))
    stub = gateway_pb2_grpc.GatewayStub(ch)
    stub.servicer = svc.servicer  # for the metrics test
    yield stub
    await ch.close()
    await svc.stop(0.5)
    await svc.servicer.close()


def engine_requests(mesh) -> int:
    """Engine requests the executor has ended (finished or aborted)."""
    s = mesh.executors[0][1].stats()
    return s.num_finished + s.num_aborted


async def test_task_equals_generate_and_cache_hits_skip_the_executor(mesh, cached_gateway):
    gw = cached_gateway
    req = build_request(chat=[("user", "Name three colours.")], max_tokens=12, temperature=0)
    ref = await generate(mesh.stub, req)                  # no result cache on the mesh's own gateway
    assert len(ref.token_ids) >= 1

    before = engine_requests(mesh)
    handle = await submit_task(gw, req)
    status = await wait_task(gw, handle.task_id, poll_s=0.05, timeout_s=300)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED and status.request_id == handle.task_id
    (choice,) = status.choices
    assert list(choice.token_ids) == ref.token_ids and choice.text == ref.text
    r = choice.result
    assert (r.cached, r.executor_id, r.usage.completion_tokens, r.request_id) == (
        False, "executor-0", len(ref.token_ids), handle.task_id)
    assert list(r.prompt_token_ids) == ref.prompt_token_ids
    assert 0 < status.created_at_unix_s <= status.started_at_unix_s <= status.finished_at_unix_s
    assert engine_requests(mesh) == before + 1

    memory_exporter().clear()
    hit = await generate(gw, req)                          # the task filled the cache
    assert (hit.token_ids, hit.text, hit.cached, hit.executor_id, hit.finish_reason) == (
        ref.token_ids, ref.text, True, "", ref.finish_reason)
    again = await wait_task(gw, (await submit_task(gw, req)).task_id, poll_s=0.05, timeout_s=60)
    (cached_choice,) = task_completions(again)
    assert (cached_choice.token_ids, cached_choice.text, cached_choice.cached) == (ref.token_ids, ref.text, True)
    assert 0 < again.created_at_unix_s <= again.started_at_unix_s <= again.finished_at_unix_s  # answered: started
    assert engine_requests(mesh) == before + 1             # neither ran the model
    name = f"chat {mesh.engines[0].model_id}"
    hits = [s.attributes["meshserve.result_cache.hit"] for s in memory_exporter().get_finished_spans()
            if s.name == name]
    assert hits == [True, True]
    assert not [s for s in memory_exporter().get_finished_spans() if s.name == "scheduler.admit"]


async def test_a_task_with_n_choices_equals_generate(mesh, cached_gateway):
    from meshserve.client import generate_choices

    req = build_request("List some fruits:", max_tokens=6, temperature=0.8, seed=3, n=2, ignore_eos=True,
                        stop=["\n\n"])
    ref = await generate_choices(mesh.stub, req)
    status = await wait_task(cached_gateway, (await submit_task(cached_gateway, req)).task_id,
                             poll_s=0.05, timeout_s=300)
    got = task_completions(status)
    assert [c.index for c in got] == [0, 1]
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got] == [
        (r.token_ids, r.text, r.finish_reason, r.stop_reason) for r in ref]


async def test_seeded_requests_are_cached_unseeded_sampling_never(mesh, cached_gateway):
    gw = cached_gateway
    seeded = build_request("Once upon a time", max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    before = engine_requests(mesh)
    first, second = await generate(gw, seeded), await generate(gw, seeded)
    assert (first.cached, second.cached) == (False, True)
    assert second.token_ids == first.token_ids and len(first.token_ids) == 8
    assert engine_requests(mesh) == before + 1
    other_seed = await generate(gw, build_request("Once upon a time", max_tokens=8, temperature=0.9, seed=12,
                                                  ignore_eos=True))
    assert not other_seed.cached and engine_requests(mesh) == before + 2
    sampled = build_request("Once upon a time", max_tokens=8, temperature=0.9, ignore_eos=True)
    outs = [await generate(gw, sampled) for _ in range(2)]
    assert [o.cached for o in outs] == [False, False]
    assert engine_requests(mesh) == before + 4


async def test_cancelling_a_running_task_frees_its_kv(mesh, cached_gateway):
    gw = cached_gateway
    eng = mesh.executors[0][1]
    prompt = [1000 + (i * 7919) % 40000 for i in range(100)]
    aborted = eng.stats().num_aborted
    handle = await submit_task(gw, build_request(prompt, max_tokens=800, temperature=0, ignore_eos=True))
    while True:
        status = await get_task(gw, handle.task_id)
        if status.state == gateway_pb2.TASK_STATE_RUNNING and eng.stats().num_running == 1:
            break
        assert status.state in (gateway_pb2.TASK_STATE_QUEUED, gateway_pb2.TASK_STATE_RUNNING), status
        await asyncio.sleep(0.01)
    assert eng.stats().num_free_blocks < eng.stats().num_blocks
    cancelled = await cancel_task(gw, handle.task_id)
    assert cancelled.state == gateway_pb2.TASK_STATE_CANCELLED and cancelled.finished_at_unix_s > 0
    while eng.stats().num_aborted == aborted:
        await asyncio.sleep(0.01)
    assert eng.stats().num_aborted == aborted + 1
    await mesh.wait_released()  # every block back and the lease released
    stats = eng.stats()
    assert stats.num_free_blocks == stats.num_blocks
    final = await get_task(gw, handle.task_id)
    assert final.state == gateway_pb2.TASK_STATE_CANCELLED and len(final.choices) == 0
    assert final.started_at_unix_s > 0 and not final.HasField("error")


async def test_tasks_and_cache_hits_are_observed_once_in_the_gateway_metrics(mesh, cached_gateway):
    """A task is a request for ``gateway.metrics``: TTFT, e2e and its outcome once;
    a result-cache hit too (its tokens come from the cache)."""
    registry = cached_gateway.servicer.core.metrics.registry
    labels = {"tenant": "default", "priority": "0"}

    def count(name: str, **extra) -> float:
        return registry.get_sample_value(name, {**labels, **extra}) or 0.0

    before = (count("meshserve_request_ttft_seconds_count"), count("meshserve_requests_total", outcome="ok"),
              count("meshserve_request_generation_tokens_total"))
    req = build_request(chat=[("user", "Name a fruit.")], max_tokens=5, temperature=0, ignore_eos=True)
    handle = await submit_task(cached_gateway, req)
    status = await wait_task(cached_gateway, handle.task_id, poll_s=0.05, timeout_s=300)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED
    hit = await generate(cached_gateway, req)  # the same greedy request: from the result cache
    assert hit.token_ids == list(status.choices[0].token_ids)
    after = (count("meshserve_request_ttft_seconds_count"), count("meshserve_requests_total", outcome="ok"),
             count("meshserve_request_generation_tokens_total"))
    assert after == (before[0] + 2, before[1] + 2, before[2] + 10)
    assert count("meshserve_gateway_requests_running") == 0



async def test_a_stopping_gateway_finishes_its_running_task_and_refuses_new_calls(mesh, tokenizer):
    """``stop_gateway`` (SIGTERM): a task running when the stop begins finishes on this
    gateway (SUCCEEDED, attempt 1, the tokens of a plain Generate), not failed or handed
    back; a call after the stop began is UNAVAILABLE."""
    import grpc

    from gateway.server import stop_gateway
    from gateway.task_api import to_status

    e0 = mesh.engines[0]
    svc = await start_gateway(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision),
                              mesh.scheduler.address, 0, tls=mesh.tls("gateway"))
    req = build_request(chat=[("user", "Write a long story.")], max_tokens=64, temperature=0, ignore_eos=True)
    ref = await generate(mesh.stub, req)
    aborted = mesh.executors[0][1].stats().num_aborted
    async with channel(svc.address, mesh.tls("client")) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        handle = await submit_task(gw, req)
        while (await get_task(gw, handle.task_id)).state != gateway_pb2.TASK_STATE_RUNNING:
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(stop_gateway(svc, 120.0))
        await asyncio.wait_for(stopping, 300)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(gw, build_request("Hello", max_tokens=2), timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    status = to_status(await svc.servicer.tasks.runner.store.get(handle.task_id))
    assert (status.state, status.attempt) == (gateway_pb2.TASK_STATE_SUCCEEDED, 1)
    assert list(status.choices[0].token_ids) == ref.token_ids
    assert mesh.executors[0][1].stats().num_aborted == aborted  # nothing was cut
    await mesh.wait_released()
