"""The core's ``include_stop_str_in_output`` (vLLM's): the stop string that ended a choice
comes as one more delta, of no tokens, right before its result, for every adapter alike;
the result cache holds the text without it, so one entry serves requests with it and
without."""

from __future__ import annotations

from contextlib import aclosing

from gateway.events import ChoiceResult, Delta, FinishReason
from gateway.generation import GatewayCore
from gateway.request import GenerationRequest
from gateway.result_cache import ResultCache
from gateway.tenants import Tenant
from meshserve.sampling import SamplingParams
from tests.support.inprocess_app import MODEL, ScriptedMesh

OUTPUT = "The answer is 42. Done here"  # tokens: The| answer| is| |4|2|.| Done| here
TENANT = Tenant("acme")


async def events_of(core: GatewayCore, include: bool, stop: tuple[str, ...] = (".",)) -> list:
    request = GenerationRequest(prompt="Q:", sampling=SamplingParams(temperature=0.0, max_tokens=9, stop=stop),
                                include_stop_str_in_output=include)
    async with aclosing(core.generate(request, TENANT)) as events:
        return [e async for e in events]


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_the_stop_string_is_a_delta_before_the_result_and_the_cache_serves_both(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    core = GatewayCore(tokenizer, MODEL, mesh, result_cache=ResultCache(8, ttl_s=60.0))
    try:
        kept = await events_of(core, True)
        cut = await events_of(core, False)  # the result cache answers: the executor ran once
        kept_again = await events_of(core, True)
    finally:
        await core.close()
    assert len(mesh.prompts) == 1
    assert kept[-2:-1] == [Delta(0, ".", (), last=True)] and isinstance(kept[-1], ChoiceResult)
    assert (kept[-1].finish_reason, kept[-1].stop_reason, kept[-1].usage.completion_tokens) == (
        FinishReason.STOP, ".", 7)
    assert [text_of(kept), text_of(cut), text_of(kept_again)] == ["The answer is 42.", "The answer is 42",
                                                                  "The answer is 42."]
    assert kept_again[-1].cached and kept_again[-2] == Delta(0, ".", (), last=True)


async def test_nothing_is_added_when_no_stop_string_ended_the_choice(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    core = GatewayCore(tokenizer, MODEL, mesh)
    try:
        events = await events_of(core, True, stop=("nowhere",))
    finally:
        await core.close()
    assert text_of(events) == OUTPUT
    assert events[-1].finish_reason == FinishReason.LENGTH and all(e.token_ids for e in events[:-1])
