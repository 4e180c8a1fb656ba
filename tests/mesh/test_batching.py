"""Continuous batching through the mesh, and every KV block back after finished,
stopped-by-string and cancelled requests."""

import asyncio

import grpc
import pytest

from meshserve.client import build_request, generate

pytestmark = pytest.mark.model


async def test_short_request_overtakes_a_long_one(mesh):
    before = (await mesh.executor_stats()).num_joined_running_batch
    order = []

    async def run(name, req):
        out = await generate(mesh.stub, req)
        order.append(name)
        return out

    long = asyncio.create_task(run("long", build_request("Once upon a time", max_tokens=160, temperature=0,
                                                         ignore_eos=True)))
    # Wait until the long request is decoding, then send a short one.
    while (await mesh.executor_stats()).num_running == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    short = await run("short", build_request("Hello", max_tokens=4, temperature=0, ignore_eos=True))
    long_out = await long
    assert order == ["short", "long"]
    assert len(short.token_ids) == 4 and len(long_out.token_ids) == 160
    stats = await mesh.executor_stats()
    assert stats.num_joined_running_batch > before
    await mesh.wait_idle()


async def test_no_block_leaks_after_finish_stop_and_cancel(mesh, default_engine):
    start = await mesh.executor_stats()
    assert start.num_free_blocks == start.num_blocks
    finished = [build_request(f"Number {i}:", max_tokens=12, temperature=0, ignore_eos=True) for i in range(3)]
    stopped = [build_request("List: a, b, c, d, e, f, g", max_tokens=40, temperature=0, ignore_eos=True,
                             stop=[","]), build_request("1 2 3 4 5 6", max_tokens=40, temperature=0,
                                                        ignore_eos=True, stop=[" "])]
    cancelled = [build_request(f"Write a long essay {i}", max_tokens=400, temperature=0, ignore_eos=True)
                 for i in range(3)]
    tasks = [asyncio.create_task(generate(mesh.stub, r)) for r in finished + stopped + cancelled]
    await asyncio.sleep(0.3)
    while (await mesh.executor_stats()).num_running < 3:
        await asyncio.sleep(0.01)
    for t in tasks[-3:]:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(len(r.token_ids) == 12 for r in results[:3])
    assert all(r.finish_reason == "stop" for r in results[3:5])
    assert all(isinstance(r, asyncio.CancelledError) for r in results[5:])
    await mesh.wait_idle()
    end = await mesh.executor_stats()
    assert end.num_free_blocks == start.num_free_blocks == end.num_blocks
    assert end.num_aborted - start.num_aborted >= 5  # 2 stop strings + 3 cancellations
    assert mesh.scheduler.servicer.core.num_leases() == 0


async def test_cancelled_call_frees_blocks_within_one_engine_step(mesh):
    engine = mesh.executors[0][1]
    call = mesh.stub.Generate(build_request("Tell me everything about the ocean", max_tokens=500, temperature=0,
                                            ignore_eos=True))
    seen = 0
    async for msg in call:
        seen += len(msg.delta.token_ids)
        if seen >= 5:
            break
    held = engine.stats()
    assert held.num_free_blocks < held.num_blocks
    call.cancel()
    while True:
        stats = engine.stats()
        if stats.num_free_blocks == stats.num_blocks:
            break
        await asyncio.sleep(0.001)
    # The step running when the cancel arrived finishes; the next one frees the blocks.
    assert stats.num_steps - held.num_steps <= 2
    assert call.cancelled()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await mesh.wait_idle()
