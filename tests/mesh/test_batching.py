"""Continuous batching through the mesh, and every KV block back after finished,
stopped-by-string and cancelled requests.

The test acts while the engine is held before a step (``StepGate``), so what the
engine does in between is fixed: no race with the engine thread, exact step counts."""

import asyncio

import grpc
import pytest

from meshserve.client import build_request, generate
from tests.support.mesh_harness import StepGate, wait_for_condition

pytestmark = pytest.mark.model


async def test_short_request_overtakes_a_long_one(mesh, default_engine):
    eng = mesh.executors[0][1]
    before = (await mesh.executor_stats()).num_joined_running_batch
    order = []

    async def run(name, req):
        out = await generate(mesh.stub, req)
        order.append(name)
        return out

    with StepGate(default_engine) as gate:
        long = asyncio.create_task(run("long", build_request("Once upon a time", max_tokens=160, temperature=0,
                                                             ignore_eos=True)))
        # the long request is decoding (its prefill and one decode step ran): send a short one
        await gate.hold(after_steps=default_engine.num_steps + 2)
        short_call = asyncio.create_task(run("short", build_request("Hello", max_tokens=4, temperature=0,
                                                                    ignore_eos=True)))
        await wait_for_condition(lambda: eng.num_queued_commands == 1, what="the short request at the engine")
    short = await short_call  # it joins the running batch at the next step: 4 steps, against the long one's 158
    long_out = await long
    assert order == ["short", "long"]
    assert len(short.token_ids) == 4 and len(long_out.token_ids) == 160
    stats = await mesh.executor_stats()
    assert stats.num_joined_running_batch > before
    await mesh.wait_idle()


async def test_no_block_leaks_after_finish_stop_and_cancel(mesh, default_engine):
    eng = mesh.executors[0][1]
    start = await mesh.executor_stats()
    assert start.num_free_blocks == start.num_blocks
    finished = [build_request(f"Number {i}:", max_tokens=12, temperature=0, ignore_eos=True) for i in range(3)]
    stopped = [build_request("List: a, b, c, d, e, f, g", max_tokens=40, temperature=0, ignore_eos=True,
                             stop=[","]), build_request("1 2 3 4 5 6", max_tokens=40, temperature=0,
                                                        ignore_eos=True, stop=[" "])]
    cancelled = [build_request(f"Write a long essay {i}", max_tokens=400, temperature=0, ignore_eos=True)
                 for i in range(3)]
    reqs = finished + stopped + cancelled
    with StepGate(default_engine) as gate:
        tasks = [asyncio.create_task(generate(mesh.stub, r)) for r in reqs]
        await gate.hold()
        # every request reached the engine (held: its request table is still), then 3 are cancelled
        await wait_for_condition(lambda: len(default_engine.batch_scheduler.requests) + eng.num_queued_commands
                                 == len(reqs), what="every request at the engine")
        for t in tasks[-3:]:
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(len(r.token_ids) == 12 for r in results[:3])
    assert all(r.finish_reason == "stop" for r in results[3:5])
    assert all(isinstance(r, asyncio.CancelledError) for r in results[5:])
    await mesh.wait_released()  # every block back and every lease released
    end = await mesh.executor_stats()
    assert end.num_free_blocks == start.num_free_blocks == end.num_blocks
    assert end.num_aborted - start.num_aborted >= 5  # 2 stop strings + 3 cancellations


async def test_cancelled_call_frees_blocks_within_one_engine_step(mesh, default_engine):
    engine = mesh.executors[0][1]
    call = mesh.stub.Generate(build_request("Tell me everything about the ocean", max_tokens=500, temperature=0,
                                            ignore_eos=True))
    seen = 0
    with StepGate(default_engine) as gate:
        async for msg in call:
            seen += len(msg.delta.token_ids)
            if seen >= 5:
                break
        held_at = await gate.hold()  # the step the cancel arrives in
        held = engine.stats()
        assert held.num_free_blocks < held.num_blocks
        call.cancel()
        await wait_for_condition(lambda: engine.num_queued_commands == 1, what="the abort at the engine")
    await wait_for_condition(lambda: engine.stats().num_free_blocks == engine.stats().num_blocks,
                             what="every block free")
    # The step running when the cancel arrived finishes; the abort frees the blocks before the next one.
    assert engine.stats().num_steps == held_at + 1
    assert call.cancelled()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await mesh.wait_idle()
