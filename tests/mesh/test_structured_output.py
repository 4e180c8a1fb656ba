"""Structured outputs through the whole mesh over gRPC ``Generate``: each of ``n``
choices has its own grammar state (seeded choices equal separate requests with seeds
s..s+n-1, every text one of the choices), logprobs are over the allowed tokens, a
JSON Schema answer parses and fits it, and a bad spec is INVALID_ARGUMENT and holds
no lease or block."""

import asyncio
import json
import math

import grpc
import pytest

from meshserve import structured_output
from meshserve.client import build_request, generate, generate_choices
from meshserve.structured_output import StructuredOutput, json_spec

pytestmark = pytest.mark.model

CHOICE = StructuredOutput("choice", choices=("yes", "no", "maybe"))
QUESTION = [("user", "Is the sky blue? Answer yes or no.")]


def constrained(spec: StructuredOutput, **kwargs):
    request = build_request(**kwargs)
    structured_output.to_proto(spec, request.sampling.structured_output)
    return request


async def test_each_choice_has_its_own_grammar_state(mesh):
    kwargs = dict(chat=QUESTION, max_tokens=8, temperature=1.5)
    choices, *separate = await asyncio.gather(
        generate_choices(mesh.stub, constrained(CHOICE, **kwargs, seed=21, n=4), timeout=60),
        *(generate(mesh.stub, constrained(CHOICE, **kwargs, seed=21 + i), timeout=60) for i in range(4)))
    assert [c.token_ids for c in choices] == [s.token_ids for s in separate]
    for c in choices:
        assert c.text in CHOICE.choices and c.finish_reason == "stop"
    await mesh.wait_idle()


async def test_logprobs_are_over_the_tokens_the_grammar_allows(mesh):
    """At the first position only the choices' first pieces are allowed: their
    probabilities sum to 1, and the other entries of the top 20 are -inf."""
    out = await generate(mesh.stub, constrained(CHOICE, chat=QUESTION, max_tokens=8, temperature=0, logprobs=20),
                         timeout=60)
    first = out.logprobs[0]
    top = [lp for _, lp in first.top]
    finite = [lp for lp in top if math.isfinite(lp)]
    assert len(top) == 20 and 0 < len(finite) < 20 and all(lp == -math.inf for lp in top[len(finite):])
    assert sum(math.exp(lp) for lp in finite) == pytest.approx(1.0, abs=1e-4)
    assert first.logprob == pytest.approx(max(finite), abs=1e-6)  # greedy took the most likely allowed token
    await mesh.wait_idle()


async def test_a_json_schema_answer_parses_and_fits_the_schema(mesh):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    out = await generate(mesh.stub, constrained(StructuredOutput("json", json_spec(schema)),
                                                chat=[("user", "Describe Paris as JSON.")], max_tokens=64,
                                                temperature=0), timeout=60)
    assert out.finish_reason == "stop", out.text
    answer = json.loads(out.text)
    assert set(answer) == {"city", "is_capital"}
    assert isinstance(answer["city"], str) and isinstance(answer["is_capital"], bool)
    await mesh.wait_idle()


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json", '{"type": "foo"}'), 'structured output json: Unsupported type "foo"'),
    (StructuredOutput("regex", "(a"), "structured output regex: "),
    (StructuredOutput("choice"), "structured output choice takes 1 to 1024 strings, got 0"),
])
async def test_a_bad_spec_is_invalid_argument_and_holds_nothing(mesh, spec, message):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(mesh.stub, constrained(spec, prompt="Hi", max_tokens=4), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(message)
    await mesh.wait_released()
