"""vLLM's ``echo`` on ``/v1/completions``: each choice's text starts with its prompt (a
token-id prompt: its decode), streamed in the choice's first chunk; with ``logprobs: k``
the prompt's tokens lead ``logprobs`` (the first with null, each later one its prompt
logprob, as ``prompt_logprobs: k`` gives them); ``max_tokens: 0`` answers the prompt
alone. How lm-evaluation-harness scores a context (``echo``, ``logprobs: 1``,
``max_tokens: 1``)."""

from __future__ import annotations

import json

import pytest

from tests.support.inprocess_app import ALTERNATIVE_IDS, ScriptedMesh, app_client, scripted_prompt_logprobs

OUTPUT = " The answer is 42."


def body(**fields) -> dict:
    return {"max_tokens": 16, "temperature": 0, **fields}


async def test_each_choice_starts_with_its_prompt_streamed_or_not(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    async with app_client(tokenizer, mesh) as http:
        text = (await http.post("/v1/completions", json=body(prompt=["Q: one", "Q: two"], n=2, echo=True))).json()
        token = (await http.post("/v1/completions", json=body(prompt=ids, echo=True))).json()
        streamed = (await http.post("/v1/completions", json=body(prompt="Q: one", n=2, echo=True,
                                                                   stream=True))).text
    assert [(c["index"], c["text"]) for c in text["choices"]] == [
        (0, "Q: one" + OUTPUT), (1, "Q: one" + OUTPUT), (2, "Q: two" + OUTPUT), (3, "Q: two" + OUTPUT)]
    assert token["choices"][0]["text"] == "The capital of France is" + OUTPUT
    assert text["usage"]["completion_tokens"] == 4 * len(tokenizer.encode(OUTPUT, add_special_tokens=False))
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.splitlines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [c["text"] for c in chunks if c["index"] == index]
        assert mine[0].startswith("Q: one") and "".join(mine) == "Q: one" + OUTPUT


async def test_echo_with_logprobs_leads_with_the_prompts_own(tokenizer):
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    mesh = ScriptedMesh(output_ids)
    prompt = "The capital of France is"
    prompt_ids = tokenizer.encode(prompt)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json=body(prompt=prompt, echo=True, logprobs=1))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    want_prompt = scripted_prompt_logprobs(prompt_ids, 1)  # what the executor sent for prompt_logprobs: 1
    texts = [tokenizer.decode([i]) for i in prompt_ids + output_ids]
    assert lp["tokens"] == texts and "".join(texts) == choice["text"] == prompt + OUTPUT
    assert lp["token_logprobs"] == [None] + [e.logprob for e in want_prompt] + [-0.25] * len(output_ids)
    assert lp["top_logprobs"][0] is None
    alternative = tokenizer.decode([ALTERNATIVE_IDS[0]])
    for i, (top, e) in enumerate(zip(lp["top_logprobs"][1:], want_prompt), 1):  # top 1, then its own when not in it
        assert top == ({texts[i]: e.logprob} if i % 2 == 0 else {alternative: -0.25, texts[i]: e.logprob})
    assert lp["top_logprobs"][len(prompt_ids):] == [{t: -0.25} for t in texts[len(prompt_ids):]]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert "prompt_logprobs" not in choice  # only when asked for by name


async def test_max_tokens_zero_with_echo_answers_the_prompt_alone(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False)[:1])
    prompt = "The capital of France is"
    prompt_ids = tokenizer.encode(prompt)
    async with app_client(tokenizer, mesh) as http:
        whole = (await http.post("/v1/completions", json=body(prompt=prompt, echo=True, logprobs=0,
                                                                max_tokens=0))).json()
        streamed = (await http.post("/v1/completions", json=body(prompt=prompt, echo=True, max_tokens=0,
                                                                   stream=True))).text
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (prompt, "length")
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in prompt_ids]
    assert choice["logprobs"]["token_logprobs"][1:] == [e.logprob for e in scripted_prompt_logprobs(prompt_ids, 0)]
    assert whole["usage"]["completion_tokens"] == 1  # the one token run, as vLLM counts it
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.splitlines() if line.startswith("data: {")]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [(prompt, "length")]  # with the last token's


@pytest.mark.parametrize("route, fields, param, message", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens",
     "max_tokens must be at least 1 (0 only with echo: the prompt alone)"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True}, "echo",
     "echo with logprobs is not available with stream: true (the prompt's logprobs come in a whole response only)"),
    ("/v1/tasks", {"prompt": "Hi", "echo": True}, "echo",
     "echo is not available for a task (its result holds the prompt's ids)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo",
     "echo is not supported (echoing the last message); only echo: false is served"),
])
async def test_what_echo_cannot_do_is_a_400_naming_the_field(tokenizer, route, fields, param, message):
    async with app_client(tokenizer) as http:
        r = await http.post(route, json=fields)
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (400, param, message)


async def test_echoed_texts_of_a_prompt_that_starts_inside_a_character_are_vllms(tokenizer):
    """vLLM's values for the same request (measured against its server): the prompt's
    first token has no entry, so the pieces after it are decoded after the prompt from
    position 1, and the generated token after the generated ones only."""
    mesh = ScriptedMesh(tokenizer.encode(" face", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json=body(prompt="😀 is a smiley", echo=True, logprobs=1,
                                                         max_tokens=1))
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["\ufffd", "", "", " is", " a", " sm", "iley", " face"]
    assert lp["text_offset"] == [0, 1, 1, 1, 4, 6, 9, 13]


async def test_the_echoed_prompt_carries_logprobs_alternatives_not_prompt_logprobs(tokenizer):
    """``logprobs: 1`` with a larger ``prompt_logprobs``: the echoed positions carry the
    top 1 (and their own token), the ``prompt_logprobs`` field all 5."""
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    prompt = "The capital of France is"
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json=body(prompt=prompt, echo=True, logprobs=1, prompt_logprobs=5))
    choice = r.json()["choices"][0]
    assert [len(top) for top in choice["logprobs"]["top_logprobs"][1:len(tokenizer.encode(prompt))]] == [2, 1, 2, 1]
    assert [len(p) for p in choice["prompt_logprobs"][1:]] == [6, 5, 6, 5]  # its own, and the top 5


async def test_with_return_token_ids_the_prompt_is_in_its_ids_not_the_text(tokenizer):
    """vLLM leaves the echoed prompt's text out when the token ids are returned."""
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    prompt = "The capital of France is"
    async with app_client(tokenizer, ScriptedMesh(output_ids)) as http:
        whole = (await http.post("/v1/completions", json=body(prompt=prompt, echo=True,
                                                                return_token_ids=True))).json()["choices"][0]
        streamed = (await http.post("/v1/completions", json=body(prompt=prompt, echo=True, return_token_ids=True,
                                                                   stream=True))).text
    assert (whole["text"], whole["prompt_token_ids"], whole["token_ids"]) == (
        OUTPUT, tokenizer.encode(prompt), output_ids)
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == OUTPUT
