"""``min_tokens`` and stop strings (vLLM's rule, ``vllm/v1/engine/detokenizer.py``): no stop
string may end in the text of a choice's first ``min_tokens`` tokens; the first one
ending after them stops the choice, even one that began inside them."""

from __future__ import annotations

import random
from contextlib import aclosing

import pytest

from gateway.choices import Choice
from gateway.events import ChoiceResult, Delta, FinishReason
from gateway.generation import GatewayCore
from gateway.mesh import ExecutorOutput
from gateway.request import GenerationRequest
from gateway.tenants import Tenant
from meshserve.sampling import SamplingParams
from tests.support.inprocess_app import MODEL, ScriptedMesh

OUTPUT = "Yes. The answer is 42. Done here"
TENANT = Tenant("acme")


async def finished(tokenizer, min_tokens: int, stop: tuple[str, ...]) -> tuple[str, ChoiceResult]:
    """The text and the result of the core over an executor that says ``OUTPUT``, one token a message."""
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    core = GatewayCore(tokenizer, MODEL, ScriptedMesh(ids))
    request = GenerationRequest(prompt="Q:", sampling=SamplingParams(
        temperature=0.0, max_tokens=len(ids), min_tokens=min_tokens, stop=stop))
    try:
        async with aclosing(core.generate(request, TENANT)) as events:
            got = [e async for e in events]
    finally:
        await core.close()
    return "".join(e.text for e in got if isinstance(e, Delta)), got[-1]


async def test_a_stop_string_inside_the_first_min_tokens_does_not_stop(tokenizer):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    first_dot = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[:i + 1]))  # the token ending "Yes."
    second_dot = next(i for i in range(first_dot + 1, len(ids)) if "." in tokenizer.decode(ids[first_dot + 1:i + 1]))
    text, result = await finished(tokenizer, first_dot, (".",))  # "Yes." ends after them: it stops
    assert (text, result.stop_reason, result.usage.completion_tokens) == ("Yes", ".", first_dot + 1)
    text, result = await finished(tokenizer, first_dot + 1, (".",))
    assert (text, result.finish_reason, result.stop_reason) == ("Yes. The answer is 42", FinishReason.STOP, ".")
    assert result.usage.completion_tokens == second_dot + 1
    text, result = await finished(tokenizer, len(ids), (".",))  # every token protected: none stops
    assert (text, result.finish_reason, result.stop_reason) == (OUTPUT, FinishReason.LENGTH, "")


async def test_a_stop_string_begun_inside_the_first_min_tokens_and_ended_after_stops(tokenizer):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    answer = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith(" answer"))
    text, result = await finished(tokenizer, answer, ("The answer",))  # " answer" is the next token
    assert (text, result.stop_reason, result.usage.completion_tokens) == ("Yes. ", "The answer", answer + 1)
    text, result = await finished(tokenizer, answer + 1, ("The answer", "42"))
    assert (text, result.stop_reason) == ("Yes. The answer is ", "42")


@pytest.mark.parametrize("per_message", [1, 3, 64])
def test_a_choice_cuts_at_the_same_place_however_its_tokens_come(tokenizer, per_message):
    """The executor sends one token a message, or several (a speculative or a
    multi-step decode): the first ``min_tokens`` are the same tokens either way."""
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    first_dot = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[:i + 1]))
    choice = Choice(0, tokenizer, tokenizer.encode("Q:"), stop=(".",), min_tokens=first_dot + 1)
    text = ""
    for start in range(0, len(ids), per_message):
        chunk = ids[start:start + per_message]
        last = start + per_message >= len(ids)
        text += choice.feed(ExecutorOutput(0, tuple(chunk), FinishReason.LENGTH if last else None), now=1.0).text
        if choice.done:
            break
    assert (text, choice.finish_reason, choice.stop_reason) == ("Yes. The answer is 42", FinishReason.STOP, ".")


TEXTS = ["The answer is 42. Done here, and there.", "Hi 你好 😀 wow. end of 😀😀 story", "x. y. z. aa bb aa bb",
         "résumé café naïve. ok"]


def cut(tokenizer, ids, stop, min_tokens, per_message, finish) -> tuple:
    """The text, finish and stop reason of a choice fed ``ids``, ``per_message`` at a time."""
    choice = Choice(0, tokenizer, [1, 2, 3], stop, (), tokenizer.eos_token_id, min_tokens)
    text = ""
    for start in range(0, len(ids), per_message):
        last = start + per_message >= len(ids)
        text += choice.feed(ExecutorOutput(0, tuple(ids[start:start + per_message]), finish if last else None),
                            now=1.0).text
        if choice.done:
            break
    return text, choice.finish_reason, choice.stop_reason


def test_the_first_min_tokens_are_protected_even_when_a_message_ends_inside_a_character(tokenizer):
    """" end" is token 11 of 19, inside the first 14; five tokens a message end one inside
    an emoji, whose piece the detokenizer holds back with the text before it."""
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    want = (TEXTS[1], FinishReason.LENGTH, "")
    assert [cut(tokenizer, ids, ["end"], 14, k, FinishReason.LENGTH) for k in (1, 5)] == [want, want]


@pytest.mark.parametrize("seed", range(100))
def test_how_the_tokens_are_grouped_into_messages_changes_no_cut(tokenizer, seed):
    """Random stop strings (pieces of the text) and min_tokens over texts with split
    characters: 2, 3, 5 or all the tokens a message cut where one a message cuts."""
    rnd = random.Random(seed)
    ids = tokenizer.encode(rnd.choice(TEXTS), add_special_tokens=False)
    finish = rnd.choice([FinishReason.LENGTH, FinishReason.STOP])
    if finish == FinishReason.STOP:
        ids.append(tokenizer.eos_token_id)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    starts = [rnd.randrange(len(full)) for _ in range(rnd.randint(1, 3))]
    stop = [full[a:a + rnd.randint(1, 4)] for a in starts]
    min_tokens = rnd.randint(0, len(ids))
    one = cut(tokenizer, ids, stop, min_tokens, 1, finish)
    assert [cut(tokenizer, ids, stop, min_tokens, k, finish) for k in (2, 3, 5, 100)] == [one] * 4
