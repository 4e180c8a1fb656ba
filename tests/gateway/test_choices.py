"""gateway.choices.Choice: one choice's stream state, fed executor outputs by hand."""

from __future__ import annotations

import pytest

from gateway.choices import Choice, RequestTimer
from gateway.events import FinishReason, TokenLogprob, TopLogprob
from gateway.mesh import ExecutorOutput


def message(ids, index=0, finish=None, cached=0, logprobs=(), prompt_logprobs=(), kvstore=0):
    return ExecutorOutput(token_ids=tuple(ids), index=index, finish_reason=finish, num_cached_tokens=cached,
                          num_kvstore_tokens=kvstore, logprobs=tuple(logprobs), prompt_logprobs=tuple(prompt_logprobs))


def lp(token_id, value, top=()):
    return TokenLogprob(token_id, value, tuple(TopLogprob(t, v) for t, v in top))


def test_two_choices_are_cut_counted_and_reported_independently(tokenizer):
    prompt = tokenizer("Say something:").input_ids
    a_ids = tokenizer(" red, green and blue", add_special_tokens=False).input_ids
    b_ids = tokenizer(" one two three", add_special_tokens=False).input_ids
    choices = [Choice(i, tokenizer, prompt, stop=[" and"]) for i in range(2)]
    timer = RequestTimer()
    texts = {0: "", 1: ""}
    pl = [lp(t, -1.0) for t in prompt[1:]]
    for k in range(max(len(a_ids), len(b_ids))):
        for index, ids in ((0, a_ids), (1, b_ids)):
            if k >= len(ids) or choices[index].done:
                continue
            last = k == len(ids) - 1
            out = message([ids[k]], index, FinishReason.LENGTH if last else None, cached=16 * index,
                          kvstore=16 * index if k == 0 else 0,  # reported with the first token
                          logprobs=[lp(ids[k], -0.5, [(ids[k], -0.5), (7, -2.0)])],
                          prompt_logprobs=pl if (k == 0 and index == 0) else ())
            delta = choices[index].feed(out, now=timer.start + k + 1)
            assert delta.index == index and list(delta.token_ids) == [ids[k]]
            assert [e.token_id for e in delta.logprobs] == [ids[k]]
            texts[index] += delta.text
    a, b = choices
    assert (a.done, a.finish_reason, a.stop_reason) == (True, FinishReason.STOP, " and")
    assert texts[0] == " red, green"
    assert (b.finish_reason, b.stop_reason, texts[1]) == (FinishReason.LENGTH, "", " one two three")
    ra = a.result("req", prompt, "executor-0", timer)
    rb = b.result("req", prompt, "executor-0", timer)
    assert (ra.index, rb.index) == (0, 1)
    assert rb.usage.completion_tokens == len(b_ids) and rb.usage.cached_tokens == 16
    assert (ra.usage.kvstore_tokens, rb.usage.kvstore_tokens) == (0, 16)
    assert ra.usage.completion_tokens < len(a_ids)  # cut at the stop string: later tokens never came
    assert [e.token_id for e in ra.prompt_logprobs] == prompt[1:] and not rb.prompt_logprobs
    assert rb.timings.ttft_s == pytest.approx(1.0) and rb.timings.tpot_s == pytest.approx(1.0)


@pytest.mark.parametrize("stop_ids, eos, finish, stop, want", [
    ((42,), None, FinishReason.STOP, (), 42),  # one of stop_token_ids ended it
    ((42,), 42, FinishReason.STOP, (), None),  # the model's EOS comes first (vLLM's check_stop)
    ((7,), None, FinishReason.STOP, (), None),  # another stop (an EOS) that is not listed
    ((42,), None, FinishReason.LENGTH, (), None),  # the length, even on a listed id
    ((42,), None, FinishReason.STOP, (" B",), None),  # a stop string in the same message: its string
])
def test_the_stop_token_id_is_the_listed_token_that_ended_the_choice(tokenizer, stop_ids, eos, finish, stop, want):
    ids = tokenizer("A B", add_special_tokens=False).input_ids
    choice = Choice(0, tokenizer, [1], stop=stop, stop_token_ids=stop_ids, eos_token_id=eos)
    choice.feed(message(ids[:1]), now=1.0)
    choice.feed(message([*ids[1:], 42], finish=finish), now=2.0)
    assert choice.done and choice.stop_token_id == want
    assert choice.stop_reason == (" B" if stop else "")
    assert choice.result("r", [1], "e", RequestTimer()).stop_token_id == want
