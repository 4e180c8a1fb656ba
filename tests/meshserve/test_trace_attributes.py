"""The GenAI semantic-convention mapping: operation names, span names, sampling
attributes, finish reasons."""

from meshserve import trace_attributes as ta
from meshserve.sampling import SamplingParams


def test_operation_and_span_names():
    assert [ta.operation_name(k) for k in ("chat", "prompt", "prompt_token_ids", None)] == \
        ["chat", "text_completion", "text_completion", "text_completion"]
    assert ta.span_name("chat", "qwen") == "chat qwen"


def test_sampling_attributes_name_only_what_is_set():
    assert ta.sampling_attributes(SamplingParams(max_tokens=9, temperature=0.0)) == {
        "gen_ai.request.max_tokens": 9, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.choice.count": 1}
    attrs = ta.sampling_attributes(SamplingParams(max_tokens=4, top_k=5, seed=11, n=3))
    assert (attrs["gen_ai.request.top_k"], attrs["gen_ai.request.seed"], attrs["gen_ai.request.choice.count"]) == \
        (5, 11, 3)


def test_finish_reasons_from_proto_numbers_and_engine_strings():
    assert ta.finish_reasons([1, 2, 3, 0, "length", None]) == ["stop", "length", "abort", "unfinished", "length",
                                                                "unfinished"]
