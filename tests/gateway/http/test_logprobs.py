"""Token logprobs in OpenAI's two shapes (``gateway.http.logprobs``), without a mesh."""

from gateway.events import TokenLogprob, TopLogprob
from gateway.http.logprobs import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs


def test_a_completion_token_outside_its_top_k_is_added_to_its_alternatives(tokenizer):
    """OpenAI's completions ``logprobs: k``: "the API will always return the logprob of
    the sampled token, so there may be up to logprobs+1 elements" (vLLM does the same);
    with ``logprobs: 0`` the sampled token is the only one."""
    texts = TokenTexts(tokenizer)
    sampled, first, second = tokenizer.encode(" was")[0], tokenizer.encode(" is")[0], tokenizer.encode(" a")[0]
    entries = [TokenLogprob(sampled, -3.0, (TopLogprob(first, -0.5), TopLogprob(second, -1.0))),  # outside the top 2
               TokenLogprob(first, -0.5, (TopLogprob(first, -0.5), TopLogprob(second, -1.0))),  # inside it
               TokenLogprob(second, -1.0)]  # logprobs 0
    out = completion_logprobs(entries, texts)
    assert out["top_logprobs"] == [{" is": -0.5, " a": -1.0, " was": -3.0}, {" is": -0.5, " a": -1.0}, {" a": -1.0}]
    assert out["tokens"] == [" was", " is", " a"] and out["token_logprobs"] == [-3.0, -0.5, -1.0]


def test_chat_alternatives_are_the_top_k_only(tokenizer):
    """Chat's ``top_logprobs`` are exactly the k most likely (OpenAI's chat shape): the
    sampled token has its own ``logprob`` beside them."""
    sampled, first = tokenizer.encode(" was")[0], tokenizer.encode(" is")[0]
    out = chat_logprobs([TokenLogprob(sampled, -3.0, (TopLogprob(first, -0.5),))], TokenTexts(tokenizer))
    assert [t["token"] for t in out["content"][0]["top_logprobs"]] == [" is"]


def test_prompt_logprobs_in_vllms_shape(tokenizer):
    """vLLM's ``prompt_logprobs``: null for the first token; per position the prompt's
    token first (rank null outside its top k: the core does not give its vocabulary
    rank; inside, its rank there and one key), then the top k ranked 1 … k; -inf is
    -9999.0 as vLLM clamps it."""
    texts = TokenTexts(tokenizer)
    own, first, second = tokenizer.encode(" was")[0], tokenizer.encode(" is")[0], tokenizer.encode(" a")[0]
    entries = [TokenLogprob(own, -3.0, (TopLogprob(first, -0.5), TopLogprob(second, -1.0))),
               TokenLogprob(first, -0.5, (TopLogprob(second, -0.25), TopLogprob(first, -0.5))),
               TokenLogprob(second, float("-inf"))]
    assert prompt_logprobs(entries, texts) == [
        None,
        {str(own): {"logprob": -3.0, "rank": None, "decoded_token": " was"},
         str(first): {"logprob": -0.5, "rank": 1, "decoded_token": " is"},
         str(second): {"logprob": -1.0, "rank": 2, "decoded_token": " a"}},
        {str(first): {"logprob": -0.5, "rank": 2, "decoded_token": " is"},
         str(second): {"logprob": -0.25, "rank": 1, "decoded_token": " a"}},
        {str(second): {"logprob": -9999.0, "rank": None, "decoded_token": " a"}},
    ]
    assert [list(p) for p in prompt_logprobs(entries, texts)[1:]][1] == [str(first), str(second)]  # own first
    assert prompt_logprobs([], texts) == [None]  # a one-token prompt
