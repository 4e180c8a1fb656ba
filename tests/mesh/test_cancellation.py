"""Case C18: cancelling a long prefill crosses every service and frees everything at
the next chunk boundary; a short request right after is not held up by it.

Engine steps stand in for wall-clock time, and they are exact: the cancel and the
short request are sent while the engine is held before a step (``StepGate``) and
both reach its queue before it goes on. The chunk in flight finishes (one step),
then the abort frees the prefill's blocks at the start of the next step, in which
the short request's prefill runs."""

import asyncio

import pytest

from meshserve.client import build_request, generate
from tests.support.engines import make_engine
from tests.support.mesh_harness import StepGate, start_local_mesh, wait_for_condition

pytestmark = pytest.mark.model
CHUNK = 256


async def test_cancelled_long_prefill_frees_everything_at_the_next_chunk(tokenizer):
    """Case C18: ~3000-token prompt, prefill chunk 256, max_tokens 1, cancelled after
    3 chunks; at once chat("Hi"), max_tokens 4."""
    engine = make_engine(max_model_len=4096, max_num_batched_tokens=CHUNK, num_blocks=400)
    m = await start_local_mesh([engine], tokenizer)
    aborted_at: list[int] = []  # engine.num_steps when the engine applied an abort

    def abort_hook(request_id):
        aborted_at.append(engine.num_steps)
        return type(engine).abort_request(engine, request_id)

    engine.abort_request = abort_hook
    try:
        eng = m.executors[0][1]
        prompt = [1000 + (i * 7919) % 40000 for i in range(3000)]
        with StepGate(engine) as gate:
            call = m.stub.Generate(build_request(prompt, max_tokens=1, temperature=0))
            reader = asyncio.create_task(call.read())
            at_cancel = await gate.hold(after_steps=3)  # 3 chunks prefilled; the 4th is the chunk in flight
            stats = eng.stats()
            assert stats.num_running == 1 and stats.num_free_blocks < stats.num_blocks  # the prefill holds blocks
            call.cancel()
            await wait_for_condition(lambda: eng.num_queued_commands == 1, what="the abort at the engine")
            short = asyncio.create_task(generate(m.stub, build_request(chat=[("user", "Hi")], max_tokens=4,
                                                                       temperature=0)))
            await wait_for_condition(lambda: eng.num_queued_commands == 2, what="the short request at the engine")
            gate.release()
            out = await short
        assert len(out.token_ids) >= 1
        assert aborted_at == [at_cancel + 1]  # the chunk in flight, then the abort
        # the short request's first token: in the step right after the chunk in flight
        # (the long prefill made no output: it was cancelled before its last chunk)
        assert gate.outputs[0][0] == at_cancel + 2
        await m.wait_released()  # every block back, no lease and nothing queued at the scheduler
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks
        reader.cancel()
    finally:
        await m.stop()
