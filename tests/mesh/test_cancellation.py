"""Case C18: cancelling a long prefill crosses every service and frees everything at
the next chunk boundary; a short request right after is not held up by it.

Engine steps stand in for wall-clock time: the cancelled prefill may finish the
chunk in flight (one step), then the abort frees its blocks at the start of the
next step, in which the short request's prefill already runs."""

import asyncio

import pytest

from meshserve.client import build_request, generate
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model
CHUNK = 256


async def test_C18_cancel_long_prefill_frees_everything_at_next_chunk(tokenizer):
    engine = make_engine(max_model_len=4096, max_num_batched_tokens=CHUNK, num_blocks=400)
    m = await start_local_mesh([engine], tokenizer)
    try:
        eng = m.executors[0][1]
        prompt = [1000 + (i * 7919) % 40000 for i in range(3000)]
        call = m.stub.Generate(build_request(prompt, max_tokens=1, temperature=0))
        reader = asyncio.create_task(call.read())
        while eng.stats().num_running == 0 or eng.stats().num_steps < 3:
            await asyncio.sleep(0.005)
        at_cancel = eng.stats()
        assert at_cancel.num_free_blocks < at_cancel.num_blocks  # the prefill holds blocks
        call.cancel()
        first_token_step: list[int] = []

        def on_delta(_text, ids):
            if ids and not first_token_step:
                first_token_step.append(eng.stats().num_steps)

        short = asyncio.create_task(generate(m.stub, build_request(chat=[("user", "Hi")], max_tokens=4,
                                                                   temperature=0), on_delta=on_delta))
        while eng.stats().num_aborted == at_cancel.num_aborted:
            await asyncio.sleep(0.001)
        freed_at = eng.stats().num_steps
        assert freed_at - at_cancel.num_steps <= 2  # the chunk in flight, then the abort
        out = await short
        assert len(out.token_ids) >= 1
        # the short request's prefill ran in the step that freed the long one, or the next
        assert first_token_step[0] - at_cancel.num_steps <= 3
        await m.wait_idle()
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert m.scheduler.servicer.core.num_leases() == 0 and len(m.scheduler.servicer.core) == 0
        reader.cancel()
    finally:
        await m.stop()
