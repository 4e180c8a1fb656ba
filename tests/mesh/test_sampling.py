"""Sampling completeness through the whole mesh: n choices (identical greedy, seeded
choices equal to separate requests with seeds s..s+3, distinct unseeded streams,
per-choice stop strings, cancelling aborts every choice), logprobs in the stream,
and case C16 (long prompt, top logprobs and prompt logprobs)."""

import asyncio

import grpc
import pytest
import pytest_asyncio

from meshserve.client import build_request, generate, generate_choices
from meshserve.sampling import MAX_LOGPROBS
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model

PROMPT = [("user", "Write one sentence about the sea.")]


async def test_greedy_n3_gives_three_identical_choices_each_with_its_result(mesh):
    choices = await generate_choices(mesh.stub, build_request(chat=PROMPT, max_tokens=8, temperature=0, n=3,
                                                              ignore_eos=True), timeout=60)
    assert [c.index for c in choices] == [0, 1, 2]
    assert len(choices[0].token_ids) == 8
    assert choices[0].token_ids == choices[1].token_ids == choices[2].token_ids
    assert {c.text for c in choices} == {choices[0].text}
    for c in choices:
        assert c.finish_reason == "length"
        assert c.usage["completion_tokens"] == 8 and c.usage["prompt_tokens"] == len(c.prompt_token_ids) > 0
        assert c.timings["ttft_s"] > 0
    with pytest.raises(ValueError, match="generate_choices"):
        await generate(mesh.stub, build_request(chat=PROMPT, max_tokens=2, temperature=0, n=2), timeout=60)
    await mesh.wait_idle()


async def test_seeded_n4_equals_four_requests_with_seeds_s_to_s_plus_3(mesh):
    kwargs = dict(chat=PROMPT, max_tokens=8, temperature=1.0, top_p=0.95, ignore_eos=True)
    choices, *separate = await asyncio.gather(
        generate_choices(mesh.stub, build_request(**kwargs, seed=40, n=4), timeout=60),
        *(generate(mesh.stub, build_request(**kwargs, seed=40 + i), timeout=60) for i in range(4)))
    assert [c.token_ids for c in choices] == [s.token_ids for s in separate]
    assert len({tuple(c.token_ids) for c in choices}) > 1
    await mesh.wait_idle()


async def test_unseeded_n4_at_temperature_1_gives_distinct_streams(mesh):
    choices = await generate_choices(mesh.stub, build_request(chat=[("user", "Name a random animal and a colour.")],
                                                              max_tokens=12, temperature=1.0, n=4, ignore_eos=True),
                                     timeout=60)
    assert len({tuple(c.token_ids) for c in choices}) == 4
    await mesh.wait_idle()


async def test_each_choice_has_its_own_stop_string_matcher(mesh):
    choices = await generate_choices(mesh.stub, build_request(chat=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                                              n=3, stop=[" "], ignore_eos=True), timeout=60)
    assert [c.index for c in choices] == [0, 1, 2]
    free = await generate_choices(mesh.stub, build_request(chat=PROMPT, max_tokens=16, temperature=1.0, seed=3, n=3,
                                                           ignore_eos=True), timeout=60)
    assert len({tuple(f.token_ids) for f in free}) == 3  # three streams, three matchers
    for c, f in zip(choices, free):
        assert " " in f.text  # each choice meets a space: its matcher has work to do
        assert (c.finish_reason, c.stop_reason) == ("stop", " ")
        assert c.text == f.text[: f.text.index(" ")]
        assert c.token_ids == f.token_ids[: len(c.token_ids)]
    await mesh.wait_idle()


async def test_cancel_aborts_every_choice_and_frees_every_block(mesh):
    eng = mesh.executors[0][1]
    before = eng.stats()
    call = mesh.stub.Generate(build_request(chat=PROMPT, max_tokens=400, temperature=1.0, n=4, ignore_eos=True))
    seen: set[int] = set()
    async for msg in call:  # wait until every choice streams
        if msg.WhichOneof("kind") == "delta" and msg.delta.token_ids:
            seen.add(msg.delta.index)
            if len(seen) == 4:
                break
    assert eng.stats().num_running == 4
    call.cancel()
    await mesh.wait_released()  # every block back and the lease released
    stats = await mesh.executor_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_aborted == before.num_aborted + 4


async def test_logprobs_travel_with_the_tokens(mesh):
    req = build_request("The capital of France is", max_tokens=6, temperature=0.7, seed=1, logprobs=3,
                        prompt_logprobs=2, n=2, ignore_eos=True)
    choices = await generate_choices(mesh.stub, req, timeout=60)
    for c in choices:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        for lp in c.logprobs:
            assert len(lp.top) == 3 and lp.logprob <= 0
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    prompt = choices[0].prompt_token_ids
    assert [lp.token_id for lp in choices[0].prompt_logprobs] == prompt[1:]
    assert all(len(lp.top) == 2 for lp in choices[0].prompt_logprobs)
    assert choices[1].prompt_logprobs == []  # on choice 0's result only
    plain = await generate(mesh.stub, build_request("The capital of France is", max_tokens=2), timeout=60)
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    await mesh.wait_idle()


@pytest_asyncio.fixture(scope="module")
async def long_mesh(tokenizer):
    """A mesh whose engine takes ~2000-token prompts (prefilled in 1024-token chunks)."""
    m = await start_local_mesh([make_engine(max_model_len=2304, max_num_batched_tokens=1024)], tokenizer)
    yield m
    await m.stop()


async def test_long_prompt_with_top_logprobs_and_prompt_logprobs(long_mesh, default_engine):
    """Case C16 asks for ~2000-token prompts, top logprobs 20, prompt logprobs on, max_tokens 128.
    A 2000-token prefill alone takes 10-25 s on the shared 2-core CPU, so this runs one
    2000-token request (two prefill chunks; its prompt logprobs cover 1999 positions,
    computed 256 rows at a time) with max_tokens 16, alongside a short request with
    other k values in the same batches, then the cap checks."""
    vocab = default_engine.vocab_size
    long_prompt = [1000 + (i * 7919) % 40000 for i in range(2000)]
    short_prompt = long_prompt[:20][::-1]
    cases = [(long_prompt, MAX_LOGPROBS, MAX_LOGPROBS), (short_prompt, 3, 0)]
    reqs = [build_request(p, max_tokens=16, temperature=0.8, seed=j, logprobs=k, prompt_logprobs=pk, ignore_eos=True)
            for j, (p, k, pk) in enumerate(cases)]
    outs = await asyncio.gather(*(generate(long_mesh.stub, r, timeout=300) for r in reqs))
    for (prompt, k, pk), out in zip(cases, outs):
        assert len(out.token_ids) == 16 and [lp.token_id for lp in out.logprobs] == out.token_ids
        assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]  # every position after the first
        for lp, size in [(lp, k) for lp in out.logprobs] + [(lp, pk) for lp in out.prompt_logprobs]:
            values = [v for _, v in lp.top]
            assert len(lp.top) == size
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values) and lp.logprob <= 0
            assert all(0 <= t < vocab for t, _ in lp.top)
            assert not values or lp.logprob <= values[0] + 1e-6
    for field in ("logprobs", "prompt_logprobs"):
        for k in (vocab, MAX_LOGPROBS + 1):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(long_mesh.stub, build_request(short_prompt, max_tokens=2, **{field: k}), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details() and str(MAX_LOGPROBS) in info.value.details()
    await long_mesh.wait_idle()
