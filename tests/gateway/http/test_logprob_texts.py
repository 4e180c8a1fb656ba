"""A logprob's token text where a token holds only part of a multi-byte character (a
byte-level tokenizer splits CJK characters and emoji): vLLM's correction, decoded after
the sampled tokens before it, so a choice's token texts join to its text and its
``text_offset`` stay inside it; streamed (a token a chunk) as whole."""

from __future__ import annotations

import json

import pytest

from gateway.events import TokenLogprob, TopLogprob
from gateway.http.logprobs import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs, sampled_context
from tests.support.inprocess_app import ScriptedMesh, app_client

TEXT = "Café 你好 🙂🚀 ok"


def test_vllms_texts_for_the_pieces_of_a_japanese_answer(tokenizer):
    """The values vLLM 0.32 answers for the same ids (measured against its server)."""
    ids = tokenizer.encode(" おわ", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == [" \ufffd", "\ufffd", "\ufffd", "\ufffd"]
    out = completion_logprobs([TokenLogprob(i, -1.0) for i in ids], TokenTexts(tokenizer))
    assert (out["tokens"], out["text_offset"]) == (["", " お", "", "わ"], [0, 0, 2, 2])
    chat = chat_logprobs([TokenLogprob(i, -1.0) for i in ids], TokenTexts(tokenizer))["content"]
    assert [(e["token"], e["bytes"]) for e in chat] == [("", []), (" お", [32, 227, 129, 138]), ("", []),
                                                        ("わ", [227, 130, 143])]


def test_token_texts_join_to_the_text_and_streamed_equals_whole(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    entries = [TokenLogprob(i, -1.0, (TopLogprob(i, -1.0),)) for i in ids]
    whole = completion_logprobs(entries, TokenTexts(tokenizer))
    assert "".join(whole["tokens"]) == TEXT
    assert all(0 <= o <= len(TEXT) for o in whole["text_offset"])
    assert [TEXT[o:o + len(t)] for o, t in zip(whole["text_offset"], whole["tokens"])] == whole["tokens"]
    assert [list(top) for top in whole["top_logprobs"]] == [[t] for t in whole["tokens"]]  # the same texts
    texts, context, offset, streamed = TokenTexts(tokenizer), sampled_context(), 0, []
    for e in entries:
        one = completion_logprobs([e], texts, offset, context)
        streamed += one["tokens"]
        offset = one["text_offset"][0] + len(one["tokens"][0])
    assert streamed == whole["tokens"]
    chat = chat_logprobs(entries, TokenTexts(tokenizer))["content"]
    assert bytes(b for e in chat for b in e["bytes"]) == TEXT.encode("utf-8")


def test_a_prompts_pieces_are_decoded_after_the_prompt(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = prompt_logprobs([TokenLogprob(i, -1.0) for i in ids[1:]], TokenTexts(tokenizer))
    decoded = [tokenizer.decode(ids[:1])] + [next(iter(p.values()))["decoded_token"] for p in out[1:]]
    assert "".join(decoded) == TEXT


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "Q:", "logprobs": 1}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Q"}],
                                                                   "logprobs": True, "top_logprobs": 1})])
async def test_http_logprob_texts_join_to_the_text_streamed_or_not(tokenizer, route, body):
    mesh = ScriptedMesh(tokenizer.encode(TEXT, add_special_tokens=False))
    body = {**body, "max_tokens": 32, "temperature": 0}
    async with app_client(tokenizer, mesh) as http:
        whole = (await http.post(route, json=body)).json()["choices"][0]
        streamed = (await http.post(route, json={**body, "stream": True})).text
    chunks = [json.loads(line[6:])["choices"] for line in streamed.splitlines() if line.startswith("data: {")]
    logprobs = [c[0]["logprobs"] for c in chunks if c and c[0]["logprobs"]]
    if route == "/v1/completions":
        assert "".join(whole["logprobs"]["tokens"]) == whole["text"] == TEXT
        assert [t for lp in logprobs for t in lp["tokens"]] == whole["logprobs"]["tokens"]
        assert [o for lp in logprobs for o in lp["text_offset"]] == whole["logprobs"]["text_offset"]
    else:
        assert "".join(e["token"] for e in whole["logprobs"]["content"]) == whole["message"]["content"] == TEXT
        assert [e for lp in logprobs for e in lp["content"]] == whole["logprobs"]["content"]
