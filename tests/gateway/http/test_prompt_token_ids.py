"""vLLM's ``return_token_ids``: besides each choice's ``token_ids``, the prompt's ids as
``prompt_token_ids``, where vLLM places them: completions on each choice (streamed: the
choice's first chunk), chat on the response (streamed: each role chunk). Without the
flag neither appears."""

from __future__ import annotations

import json

import pytest

from tests.support.inprocess_app import ScriptedMesh, app_client

OUTPUT = "The answer is 42."


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_completions_carry_each_prompts_ids_on_its_choices(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    prompts = ["Q: one", "Q: two, three"]
    want = [tokenizer.encode(p) for p in prompts]
    body = {"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    async with app_client(tokenizer, mesh) as http:
        whole = (await http.post("/v1/completions", json=body)).json()
        streamed = events((await http.post("/v1/completions", json={**body, "stream": True})).text)
        plain = (await http.post("/v1/completions", json={**body, "return_token_ids": False})).json()
    assert [(c["index"], c["prompt_token_ids"]) for c in whole["choices"]] == [
        (0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    firsts = {}
    for chunk in streamed:
        for c in chunk["choices"]:
            if c["index"] not in firsts:
                firsts[c["index"]] = c
            else:
                assert "prompt_token_ids" not in c  # the first chunk of the choice only
    assert {i: c["prompt_token_ids"] for i, c in firsts.items()} == {0: want[0], 1: want[0], 2: want[1],
                                                                     3: want[1]}
    assert all("prompt_token_ids" not in c for c in plain["choices"])


@pytest.mark.parametrize("n", [1, 2])
async def test_chat_carries_the_prompts_ids_on_the_response_and_the_role_chunks(tokenizer, n):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    messages = [{"role": "user", "content": "Hi"}]
    want = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    body = {"messages": messages, "n": n, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    async with app_client(tokenizer, mesh) as http:
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        streamed = events((await http.post("/v1/chat/completions", json={**body, "stream": True})).text)
        plain = (await http.post("/v1/chat/completions", json={**body, "return_token_ids": False})).json()
    assert whole["prompt_token_ids"] == want and whole["usage"]["prompt_tokens"] == len(want)
    roles = [e for e in streamed if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert [(e["choices"][0]["index"], e["prompt_token_ids"]) for e in roles] == [(i, want) for i in range(n)]
    assert all("prompt_token_ids" not in e for e in streamed if e not in roles)
    assert "prompt_token_ids" not in plain
