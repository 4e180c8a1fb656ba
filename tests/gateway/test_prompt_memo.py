"""The prompt memo: a repeated prompt gets the very ids the builder gives (raw text,
chat with control-token text inside a message: C05), without building them again;
long prompts, invalid prompts and token-id prompts are not remembered; the least
recently used prompt leaves first."""

from __future__ import annotations

import pytest

from gateway.prompt import PromptBuilder
from gateway.prompt_memo import PromptMemo
from gateway.request import GenerationRequest
from meshserve.errors import InvalidArgument


class CountingBuilder(PromptBuilder):
    """The real builder, counting its builds."""

    builds = 0

    def from_request(self, request):
        self.builds += 1
        return super().from_request(request)


@pytest.fixture
def builder(tokenizer):
    return CountingBuilder(tokenizer)


def test_a_repeated_prompt_gets_the_builders_ids_without_a_second_build(builder, tokenizer):
    memo = PromptMemo(builder)
    text = GenerationRequest(prompt="Name three rivers.")
    chat = GenerationRequest(chat=(("system", "Be brief."), ("user", "Say <|im_end|> literally.")))
    reference = PromptBuilder(tokenizer)
    for request in (text, chat):
        assert memo.lookup(request) is None
        assert memo.build(request) == reference.from_request(request)
        assert memo.lookup(request) == reference.from_request(request)
    assert (builder.builds, memo.hits) == (2, 2)
    ids = memo.lookup(text)
    ids.append(0)                                         # a caller's copy: the memo is unchanged
    assert memo.lookup(text) == reference.from_request(text)


def test_long_invalid_and_token_id_prompts_are_not_remembered(builder):
    memo = PromptMemo(builder, max_chars=10)
    long = GenerationRequest(prompt="x" * 11)
    memo.build(long)
    assert memo.lookup(long) is None
    with pytest.raises(InvalidArgument):
        memo.build(GenerationRequest(prompt=""))
    assert memo.lookup(GenerationRequest(prompt="")) is None
    ids = GenerationRequest(prompt_token_ids=(1, 2, 3))
    assert memo.build(ids) == [1, 2, 3] and memo.lookup(ids) is None


def test_the_least_recently_used_prompt_leaves_first(builder):
    memo = PromptMemo(builder, max_entries=2)
    a, b, c = (GenerationRequest(prompt=p) for p in ("alpha", "beta", "gamma"))
    memo.build(a)
    memo.build(b)
    assert memo.lookup(a) is not None                     # a used: b is now the oldest
    memo.build(c)
    assert [memo.lookup(r) is not None for r in (a, b, c)] == [True, False, True]
