"""AsyncEngine: concurrent streams, errors before output, cancellation frees blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from executor.engine.async_engine import AsyncEngine
from meshserve.errors import InvalidArgument, ResourceExhausted
from meshserve.sampling import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def async_engine(engine):
    seen = []
    eng = AsyncEngine(engine, on_stats=seen.append)
    eng.seen_stats = seen
    await eng.start()
    yield eng
    await eng.stop()
    assert engine.stats().num_free_blocks == engine.num_blocks


async def collect(eng: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for out in eng.generate(request_id, prompt, params):
        tokens += out.new_token_ids
        reason = out.finish_reason
    return tokens, reason


async def wait_until(predicate, max_polls: int = 2000) -> None:
    for _ in range(max_polls):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_concurrent_generate_matches_offline(engine, async_engine, tokenizer):
    prompts = [tokenizer(t).input_ids for t in ("Hello", "The sky is", "1, 2, 3,", "Paris is the capital of")]
    results = await asyncio.gather(*(collect(async_engine, f"c{i}", p) for i, p in enumerate(prompts)))
    assert all(reason == "length" and len(tokens) == 6 for tokens, reason in results)
    await async_engine.stop()  # the engine thread is gone: offline generate may use the engine again
    expected = engine.generate(prompts, GREEDY)
    assert [tokens for tokens, _ in results] == expected
    await wait_until(lambda: async_engine.seen_stats and async_engine.seen_stats[-1].num_running == 0)
    assert async_engine.stats().num_finished >= 4


async def test_errors_are_raised_before_any_output(async_engine):
    with pytest.raises(InvalidArgument, match="must not be empty"):
        await collect(async_engine, "e1", [])
    with pytest.raises(InvalidArgument, match="max_tokens"):
        await collect(async_engine, "e2", [1, 2], SamplingParams(max_tokens=0))
    stream = async_engine.generate("dup", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    await stream.__anext__()
    with pytest.raises(InvalidArgument, match="already in use"):
        await collect(async_engine, "dup", [1])
    await stream.aclose()


async def test_aclose_aborts_and_frees_blocks(engine, async_engine):
    start = async_engine.stats()
    stream = async_engine.generate("long", [1] * 40, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    for _ in range(2):
        out = await stream.__anext__()
        assert not out.finished
    assert async_engine.stats().num_free_blocks < engine.num_blocks
    await stream.aclose()
    await wait_until(lambda: async_engine.stats().num_free_blocks == engine.num_blocks
                     and async_engine.stats().num_running == 0)
    assert async_engine.stats().num_aborted == start.num_aborted + 1


async def test_task_cancel_aborts_and_frees_blocks(engine, async_engine):
    first = asyncio.Event()

    async def consume():
        async for _ in async_engine.generate("cancel-me", [5] * 30,
                                             SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: async_engine.stats().num_free_blocks == engine.num_blocks
                     and async_engine.stats().num_running == 0)
    engine_free = async_engine.stats().num_free_blocks
    assert engine_free == engine.num_blocks


async def test_unread_stream_is_bounded_then_ended_and_frees_blocks(engine, tokenizer):
    """Case C27: a consumer that stops reading holds at most ``max_buffered_outputs`` outputs;
    the next output ends its request (ResourceExhausted after those queued) and
    frees its blocks, while a request read normally runs to the offline result."""
    bound = 3
    eng = AsyncEngine(engine, max_buffered_outputs=bound)
    await eng.start()
    try:
        slow = eng.generate("slow", [7] * 20, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        first = await slow.__anext__()  # then read nothing
        prompt = tokenizer("The sky is").input_ids
        normal = await collect(eng, "normal", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))
        await wait_until(lambda: eng.num_overflowed == 1)
        await wait_until(lambda: eng.stats().num_free_blocks == engine.num_blocks and eng.stats().num_running == 0)
        assert eng.max_buffered_seen == bound
        assert eng.stats().num_aborted >= 1
        rest = [await slow.__anext__() for _ in range(bound)]  # what was queued is still delivered
        with pytest.raises(ResourceExhausted, match=f"bound {bound}"):
            await slow.__anext__()
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 1 + bound
        assert not any(o.finished for o in rest)
    finally:
        await eng.stop()
    assert normal == (engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                               ignore_eos=True))[0], "length")
    assert engine.stats().num_free_blocks == engine.num_blocks


def test_max_buffered_outputs_must_be_positive(engine):
    with pytest.raises(ValueError, match="max_buffered_outputs must be >= 1"):
        AsyncEngine(engine, max_buffered_outputs=0)


async def test_request_that_finishes_at_the_bound_is_delivered_whole(engine):
    """Case C27: a slow reader whose request *finished* with one output past the bound gets the
    whole result: the finished output ends the request (nothing is left to abort), so
    it is queued, not turned into ResourceExhausted, and no slow-reader abort is counted."""
    bound = 3
    params = SamplingParams(max_tokens=bound + 2, temperature=0.0, ignore_eos=True)  # bound + 2 outputs
    prompt = [5] * 20
    eng = AsyncEngine(engine, max_buffered_outputs=bound)
    await eng.start()
    try:
        stream = eng.generate("done", prompt, params)
        first = await stream.__anext__()  # starts the request; its first output is taken
        assert first.finished is False
        # the consumer now reads nothing: bound + 1 outputs remain, the last one finished
        # every output dispatched: the finished one is queued one past the bound
        await wait_until(lambda: eng.max_buffered_seen == bound + 1)
        assert eng.stats().num_finished >= 1 and eng.stats().num_running == 0
        outs = [first] + [out async for out in stream]
    finally:
        await eng.stop()
    assert [o.finished for o in outs] == [False] * (bound + 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert eng.num_overflowed == 0
    assert [t for o in outs for t in o.new_token_ids] == engine.generate([prompt], params)[0]


async def test_request_id_reused_after_overflow_gets_only_its_own_outputs(engine):
    """Case C27: after a slow reader's request was ended, the same id may be used again at once
    (a retry): the new request must not receive outputs the engine produced for the old
    one before it applied the abort."""
    bound = 2
    old_params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    new_prompt, new_params = [9] * 12, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng = AsyncEngine(engine, max_buffered_outputs=bound)
    await eng.start()
    try:
        old = eng.generate("same", [7] * 20, old_params)
        await old.__anext__()
        # the loop is busy while the engine thread keeps stepping: its outputs queue up
        # as callbacks; the first past the bound ends "same", while the thread is mid-step
        generated = eng.stats().num_generation_tokens
        deadline = time.monotonic() + 60
        while eng.stats().num_generation_tokens < generated + bound + 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # blocks the loop: the thread's outputs wait as callbacks
        await asyncio.sleep(0)
        assert eng.num_overflowed == 1
        reused = await collect(eng, "same", new_prompt, new_params)  # registered before the abort is applied
        with pytest.raises(ResourceExhausted):
            async for _ in old:
                pass
        await wait_until(lambda: eng.stats().num_running == 0 and eng.stats().num_waiting == 0)
    finally:
        await eng.stop()
    assert reused == (engine.generate([new_prompt], new_params)[0], "length")
    assert engine.stats().num_free_blocks == engine.num_blocks
