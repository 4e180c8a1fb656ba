"""Bad input gets INVALID_ARGUMENT naming the field or limit, loses nothing, and the
mesh keeps serving (cases C09, C11, C12 at the API level).

"At once" (C09, C11) is shown by order, not by a stopwatch: the rejection arrives
while the engine is held before a step (``StepGate``), so it waits for no engine
step, whatever the machine's speed."""

import asyncio
import math

import grpc
import pytest

from meshserve.client import build_request, generate
from tests.support.mesh_harness import StepGate

pytestmark = pytest.mark.model


async def expect_code(mesh, request, code, *needles):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(mesh.stub, request, timeout=30)
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details()
    return info.value.details()


async def canary(mesh):
    """chat('Hi'), max_tokens 4, greedy: completes (the bound only stops a hang)."""
    out = await asyncio.wait_for(
        generate(mesh.stub, build_request(chat=[("user", "Hi")], max_tokens=4, temperature=0)), 300
    )
    assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 4


INVALID = [
    (dict(prompt="hello", max_tokens=0), "max_tokens"),
    (dict(prompt="hello", max_tokens=-3), "max_tokens"),
    (dict(prompt="hello", max_tokens=2**31), "max_tokens"),
    (dict(prompt="hello", temperature=-1.0), "temperature"),
    (dict(prompt="hello", temperature=math.nan), "temperature"),
    (dict(prompt="hello", temperature=math.inf), "temperature"),
    (dict(prompt="hello", top_p=0.0), "top_p"),
    (dict(prompt="hello", top_p=1.5), "top_p"),
    (dict(prompt="hello", top_k=-5), "top_k"),
    (dict(prompt="hello", min_p=1.5), "min_p"),
    (dict(prompt="hello", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hello", presence_penalty=2.5), "presence_penalty"),
    (dict(prompt="hello", frequency_penalty=-3.0), "frequency_penalty"),
    (dict(prompt="hello", max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(prompt="hello", n=0), "n must be in [1, 16]"),
    (dict(prompt="hello", n=17), "n must be in [1, 16]"),
    (dict(prompt="hello", logprobs=21), "logprobs must be in [0, 20]"),
    (dict(prompt="hello", prompt_logprobs=-1), "prompt_logprobs must be in [0, 20]"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt_token_ids"),
    (dict(prompt=[10**6]), "prompt_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
async def test_invalid_parameters_name_the_field(mesh, kwargs, field):
    await expect_code(mesh, build_request(**kwargs), grpc.StatusCode.INVALID_ARGUMENT, field)


async def test_empty_prompt_among_good_ones_is_rejected_alone(mesh):
    """Case C09: an empty prompt in a batch of good ones gets INVALID_ARGUMENT; the
    others complete, and so does the canary after it."""
    good = [build_request(f"Count to {i}:", max_tokens=4, temperature=0) for i in range(3)]
    results = await asyncio.gather(
        *(generate(mesh.stub, r) for r in good), generate(mesh.stub, build_request("")), return_exceptions=True
    )
    assert [r.finish_reason for r in results[:3]] == ["length"] * 3
    assert isinstance(results[3], grpc.aio.AioRpcError)
    assert results[3].code() == grpc.StatusCode.INVALID_ARGUMENT
    await expect_code(mesh, build_request([]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids")
    await canary(mesh)
    await mesh.wait_idle()


async def test_prompt_over_max_model_len_is_rejected_at_once_and_over_length_is_clamped(mesh, default_engine):
    """Case C11 (a), (b): with 4 requests in flight, (a) a prompt of max_model_len + 1
    tokens is rejected, naming the limit, while the engine is held before a step (it
    waits for none); (b) max_model_len - 4 prompt tokens with max_tokens 16 are clamped
    and finish "length" at max_model_len. The in-flight requests and the canary
    complete; the rejected request holds no block and no queue slot."""
    max_len = default_engine.max_model_len
    in_flight = [
        asyncio.create_task(generate(mesh.stub, build_request(chat=[("user", f"Story {i}")], max_tokens=24,
                                                              temperature=0, ignore_eos=True)))
        for i in range(4)
    ]
    with StepGate(default_engine) as gate:
        held_at = await gate.hold()  # at the first step with work: none of the 4 can finish while held
        details = await expect_code(mesh, build_request([7] * (max_len + 1), max_tokens=4),
                                    grpc.StatusCode.INVALID_ARGUMENT, str(max_len))
        assert default_engine.num_steps == held_at  # rejected while no engine step could run
    assert "max_model_len" in details
    # (b) max_model_len - 4 prompt tokens with max_tokens 16: clamped, finishes "length" at max_model_len.
    out = await generate(mesh.stub, build_request([7] * (max_len - 4), max_tokens=16, temperature=0,
                                                  ignore_eos=True), timeout=600)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 4
    done = await asyncio.gather(*in_flight)
    assert [len(o.token_ids) for o in done] == [24] * 4
    await canary(mesh)
    await mesh.wait_idle()
    assert mesh.scheduler.servicer.core.num_leases() == 0
    assert len(mesh.scheduler.servicer.core) == 0


async def test_tiny_zero_and_invalid_sampling_parameters(mesh):
    """Case C12: tiny positive temperature or top_p, top_k 1 and min_p 1 give exactly
    the greedy tokens; invalid values get INVALID_ARGUMENT naming the field; normal
    requests in the same batch are unaffected."""
    base = dict(chat=[("user", "Name three colors.")], max_tokens=32)
    greedy_variants = [dict(temperature=1e-4), dict(temperature=1e-6), dict(temperature=0),
                       dict(top_p=1e-4, temperature=1.0, seed=1), dict(top_k=1, temperature=1.0, seed=2),
                       dict(min_p=1.0, temperature=1.0, seed=3)]  # min_p 1 keeps only the most likely token
    normal = [build_request(chat=[("user", f"Say hello {i}")], max_tokens=16, temperature=0.8, seed=i)
              for i in range(4)]
    invalid = [dict(temperature=-1.0), dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=1.5),
               dict(top_k=-5), dict(max_tokens=2**31), dict(top_p=0.0), dict(min_p=-0.1), dict(min_p=math.nan),
               dict(repetition_penalty=-1.0), dict(presence_penalty=math.inf), dict(frequency_penalty=2.01),
               dict(n=0), dict(n=64), dict(logprobs=49152), dict(prompt_logprobs=21)]
    reqs = [build_request(**base, **v) for v in greedy_variants]
    reqs += [build_request(**{**base, **v}) for v in invalid]
    results = await asyncio.gather(*(generate(mesh.stub, r) for r in reqs + normal), return_exceptions=True)
    greedy = results[0 : len(greedy_variants)]
    ref = greedy[2].token_ids
    assert len(ref) > 0
    for variant, out in zip(greedy_variants, greedy):
        assert out.token_ids == ref, variant
    fields = ["temperature", "temperature", "temperature", "top_p", "top_k", "max_tokens", "top_p", "min_p", "min_p",
              "repetition_penalty", "presence_penalty", "frequency_penalty", "n must", "n must",
              "logprobs must be in [0, 20]", "prompt_logprobs must be in [0, 20]"]
    for fieldname, err in zip(fields, results[len(greedy_variants) : len(greedy_variants) + len(invalid)]):
        assert isinstance(err, grpc.aio.AioRpcError)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fieldname in err.details()
    for out in results[-4:]:
        assert out.finish_reason in ("stop", "length") and len(out.token_ids) >= 1
    await mesh.wait_idle()


async def test_top_k_zero_means_off(mesh):
    a = await generate(mesh.stub, build_request("The sky is", max_tokens=8, temperature=0.9, top_k=0, seed=11))
    b = await generate(mesh.stub, build_request("The sky is", max_tokens=8, temperature=0.9, seed=11))
    assert a.token_ids == b.token_ids


async def test_no_executor_is_unavailable(tokenizer, default_engine):
    from gateway.request import ModelInfo
    from gateway.server import start_gateway
    from meshserve.client import channel
    from meshserve.v1 import gateway_pb2_grpc
    from scheduler.server import start_scheduler

    scheduler = await start_scheduler(0)
    info = ModelInfo(default_engine.model_id, default_engine.max_model_len, default_engine.vocab_size)
    gw = await start_gateway(tokenizer, info, scheduler.address, 0)
    try:
        async with channel(gw.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(gateway_pb2_grpc.GatewayStub(ch), build_request("hello", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no executor" in err.value.details()
    finally:
        await gw.stop(0.1)
        await gw.servicer.close()
        await scheduler.stop(0.1)


async def test_prompt_over_the_step_budget_without_chunked_prefill_is_rejected_at_once(tokenizer):
    """Case C11 (c): with chunked prefill off, a prompt larger than the per-step token
    budget is rejected, naming the budget, while the engine is held before a step with
    a request in flight (it waits for no engine step); the request in flight and the
    canary complete, and the rejected one holds no lease."""
    from tests.support.engines import make_engine
    from tests.support.mesh_harness import start_local_mesh

    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=256, num_blocks=64)
    m = await start_local_mesh([engine], tokenizer)
    try:
        in_flight = asyncio.create_task(generate(m.stub, build_request(chat=[("user", "Story")], max_tokens=24,
                                                                       temperature=0, ignore_eos=True)))
        with StepGate(engine) as gate:
            held_at = await gate.hold()
            await expect_code(m, build_request([5] * 300, max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "256")
            assert engine.num_steps == held_at  # rejected while no engine step could run
        assert len((await in_flight).token_ids) == 24
        await canary(m)
        await m.wait_idle()
        assert m.scheduler.servicer.core.num_leases() == 0
    finally:
        await m.stop()
