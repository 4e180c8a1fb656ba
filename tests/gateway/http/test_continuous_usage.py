"""vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
carries its choice's usage so far (its prompt's tokens, the tokens it has generated up to
and including that chunk's), the last chunk the whole request's as with ``include_usage``
alone; without ``include_usage`` it asks for nothing (vLLM's ``should_include_usage``)."""

from __future__ import annotations

import json

import pytest

from tests.support.inprocess_app import ScriptedMesh, app_client

OUTPUT = " one two three four"


def chunks_of(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("route, body, prompts", [
    ("/v1/completions", {"prompt": ["Q: a", "Q: b c d"], "n": 2}, ["Q: a", "Q: b c d"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Q"}], "n": 2}, None),
])
async def test_each_chunk_carries_its_choices_usage_so_far(tokenizer, route, body, prompts):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with app_client(tokenizer, ScriptedMesh(ids)) as http:
        chunks = chunks_of((await http.post(route, json={**body, "max_tokens": 8, "stream": True,
                                                         "return_token_ids": True, "stream_options": options})).text)
    if prompts is None:
        prompt_tokens = [len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))]
    else:
        prompt_tokens = [len(tokenizer.encode(p)) for p in prompts]
    *streamed, last = chunks
    seen: dict[int, int] = {}
    for c in streamed:
        [choice] = c["choices"]
        index = choice["index"]
        seen[index] = seen.get(index, 0) + len(choice.get("token_ids", []))  # none in a role chunk
        prompt = prompt_tokens[index // 2]
        assert c["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen[index],
                              "total_tokens": prompt + seen[index]}
    assert sorted(seen.values()) == [len(ids)] * len(seen)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(ids) * len(seen)


async def test_without_include_usage_it_asks_for_nothing(tokenizer):
    async with app_client(tokenizer, ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))) as http:
        r = await http.post("/v1/completions", json={"prompt": "Q", "max_tokens": 4, "stream": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 200 and all("usage" not in c for c in chunks_of(r.text))
