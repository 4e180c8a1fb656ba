"""Finished choices from a request's events, and the events a result-cache hit replays."""

from __future__ import annotations

import time

from gateway.collector import ChoiceCollector, replay
from gateway.events import ChoiceResult, Delta, FinishReason, Queued, Timings, TokenLogprob, Usage


def delta(index, text, ids, logprobs=()):
    return Delta(index, text, tuple(ids), tuple(TokenLogprob(i, lp) for i, lp in logprobs))


def result(index, reason, completion_tokens):
    return ChoiceResult(request_id="r1", index=index, finish_reason=reason, executor_id="executor-0",
                        prompt_token_ids=(5, 6), usage=Usage(prompt_tokens=2, completion_tokens=completion_tokens,
                                                             cached_tokens=1),
                        timings=Timings(queue_s=0.5, ttft_s=1.0, tpot_s=0.1, e2e_s=2.0))


def stream(reason_1=FinishReason.LENGTH):
    return [Queued(position=0, estimated_wait_s=0.0),
            delta(1, "Hel", [10], [(10, -0.5)]), delta(0, "A", [20]),
            delta(1, "lo", [11, 12], [(11, -1.0), (12, -2.0)]),
            result(0, FinishReason.STOP, 1), result(1, reason_1, 3)]


def test_choices_gather_text_tokens_logprobs_and_result():
    c = ChoiceCollector()
    for msg in stream():
        c.feed(msg)
    choices = c.choices()
    assert [(x.index, x.text, list(x.token_ids)) for x in choices] == [(0, "A", [20]), (1, "Hello", [10, 11, 12])]
    assert [(lp.token_id, lp.logprob) for lp in choices[1].logprobs] == [(10, -0.5), (11, -1.0), (12, -2.0)]
    assert choices[1].result.usage.completion_tokens == 3 and choices[1].result.executor_id == "executor-0"
    assert c.complete(2) and not c.complete(3)


def test_aborted_or_missing_choices_are_not_complete():
    aborted = ChoiceCollector()
    for msg in stream(FinishReason.ABORT):
        aborted.feed(msg)
    assert not aborted.complete(2)
    partial = ChoiceCollector()
    for msg in stream()[:-1]:
        partial.feed(msg)
    assert not partial.complete(2)


def test_replay_sends_each_choice_whole_and_marks_it_cached():
    c = ChoiceCollector()
    for msg in stream():
        c.feed(msg)
    out = replay(c.choices(), "r2", time.monotonic() - 5.0)  # the request came 5 s ago
    assert [type(m) for m in out] == [Delta, ChoiceResult, Delta, ChoiceResult]
    assert (out[2].index, out[2].text, list(out[2].token_ids)) == (1, "Hello", [10, 11, 12])
    assert len(out[2].logprobs) == 3
    r = out[3]
    assert (r.request_id, r.index, r.cached, r.executor_id, r.finish_reason) == (
        "r2", 1, True, "", FinishReason.LENGTH)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, list(r.prompt_token_ids)) == (2, 3, [5, 6])
    assert r.timings.queue_s == 0.0 and r.timings.ttft_s == r.timings.e2e_s >= 5.0  # now - start, whatever the speed
    assert not c.choices()[1].result.cached   # the stored choices are untouched
