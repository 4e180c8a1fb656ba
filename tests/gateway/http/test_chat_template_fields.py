"""vLLM's chat extras on ``POST /v1/chat/completions`` (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, a message's ``name``): the
prompt the executor gets and the usage's ``prompt_tokens`` are exactly the
templated prompt's ids; contradictory or malformed values are 400 naming the
field; ``POST /v1/tasks`` carries them in its stored request to the same prompt."""

from __future__ import annotations

import json

import pytest

from tests.support.inprocess_app import ScriptedMesh, app_client, finished_task

QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}


def hf(tokenizer, messages, **kwargs) -> list[int]:
    """transformers' own ids for the same messages and arguments."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def nested(depth: int):
    """A JSON value ``depth`` objects and arrays deep."""
    value = 1
    for i in range(depth):
        value = {"a": value} if i % 2 else [value]
    return value


def error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}}


async def test_continue_final_message_continues_the_assistants_message(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Paris.", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/chat/completions", json={
            "messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True})
    want = hf(tokenizer, [QUESTION, PREFILL], continue_final_message=True)
    assert r.status_code == 200 and mesh.prompts == [want]
    assert tokenizer.decode(want).endswith("<|im_start|>assistant\nThe capital of France is")
    assert r.json()["usage"]["prompt_tokens"] == len(want) == 42
    assert r.json()["choices"][0]["message"]["content"] == " Paris."


async def test_the_same_messages_with_other_options_are_another_prompt(tokenizer):
    """The prompt memo keys on the options too: the second request is not served the first's ids."""
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        usages = []
        for extra in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": None}):
            r = await http.post("/v1/chat/completions", json={"messages": [QUESTION], **extra})
            usages.append(r.json()["usage"]["prompt_tokens"])
    with_header, without = hf(tokenizer, [QUESTION], add_generation_prompt=True), hf(tokenizer, [QUESTION])
    assert mesh.prompts == [with_header, without, with_header]  # null is the default (true)
    assert usages == [len(with_header), len(without), len(with_header)] == [37, 33, 37]


async def test_template_kwargs_nested_up_to_the_limit_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m.content }}\n{% endfor %}"
                        "[{{ mood | length }}]assistant:")
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [QUESTION],
                                                          "chat_template_kwargs": {"mood": nested(31)}})
    assert r.status_code == 200
    assert [tokenizer.decode(p) for p in mesh.prompts] == ["What is the capital of France?\n[1]assistant:"]


@pytest.mark.parametrize("kwargs, failure", [
    ({"date_string": 5}, 'TypeError: can only concatenate str (not "int") to str'),
    ({"date_string": "x", "days": 0}, "ZeroDivisionError: division by zero"),
])
async def test_template_kwargs_the_template_fails_on_are_a_400_naming_them(tokenizer, monkeypatch, kwargs, failure):
    """A variable of the wrong type for the template (as Llama 3's ``date_string``) was
    an unhandled 500 with a traceback."""
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m.content }}\n{% endfor %}"
                        "{{ 'Today Date: ' + date_string }}{% if days is defined %}{{ 7 / days }}{% endif %}")
    async with app_client(tokenizer) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [QUESTION], "chat_template_kwargs": kwargs})
    assert (r.status_code, r.json()) == (400, error(
        f"chat_template_kwargs: the model's chat template failed with them: {failure}", "chat_template_kwargs"))


async def test_names_and_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }})"
                        "{% endif %}: {{ m.content }}\n{% endfor %}[{{ mood }}]assistant:")
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello", "name": "ann"}],
            "chat_template_kwargs": {"mood": "calm"}})
    assert r.status_code == 200
    assert [tokenizer.decode(p) for p in mesh.prompts] == ["user (ann): Hello\n[calm]assistant:"]
    assert r.json()["usage"]["prompt_tokens"] == len(mesh.prompts[0])


@pytest.mark.parametrize("body, want", [
    ({"messages": [QUESTION, PREFILL], "continue_final_message": True},
     error("continue_final_message cannot be used with add_generation_prompt: true (set add_generation_prompt "
           "to false)", "continue_final_message")),
    ({"messages": [QUESTION], "continue_final_message": True, "add_generation_prompt": False},
     error("continue_final_message needs the last message to be the assistant's, got role 'user'",
           "continue_final_message")),
    ({"messages": [QUESTION], "chat_template_kwargs": "calm"},
     error("chat_template_kwargs: Input should be an object", "chat_template_kwargs")),
    ({"messages": [QUESTION], "chat_template_kwargs": {"tokenize": False}},
     error("chat_template_kwargs.tokenize is not a template variable meshserve passes on (it is a parameter of "
           "the rendering itself, or the messages)", "chat_template_kwargs.tokenize")),
    ({"messages": [QUESTION], "add_generation_prompt": 0},
     error("add_generation_prompt: Input should be a valid boolean", "add_generation_prompt")),
    ({"messages": [{**QUESTION, "name": 7}]}, error("messages.0.name: Input should be a valid string",
                                                   "messages.0.name")),
    ({"messages": [{**QUESTION, "name": "a\ud800"}]},  # counted and checked with the contents
     error("messages[0].name is not valid Unicode: a lone surrogate at character 1", "messages.0.name")),
    ({"messages": [QUESTION], "chat_template_kwargs": {"mood": "\ud800"}},
     error("chat_template_kwargs is not valid Unicode: a lone surrogate at character 10", "chat_template_kwargs")),
    ({"messages": [QUESTION], "chat_template_kwargs": {"mood": nested(32)}},  # 700 deep was a 500 (RecursionError)
     error("chat_template_kwargs: nests deeper than 32 levels of objects and arrays", "chat_template_kwargs")),
    ({"messages": [QUESTION], "chat_template_kwargs": {"mood": nested(700)}},
     error("chat_template_kwargs: nests deeper than 32 levels of objects and arrays", "chat_template_kwargs")),
])
async def test_bad_values_are_400_naming_the_field(tokenizer, body, want):
    async with app_client(tokenizer) as http:
        r = await http.post("/v1/chat/completions", content=json.dumps(body),  # ASCII: a lone surrogate as \ud800
                            headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (400, want)


# a template that shows names, one variable and the generation prompt
NAMED_TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n"
                  "{% endfor %}{% if mood %}[{{ mood }}]{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
ASKED = "user: What is the capital of France?\n"


@pytest.mark.parametrize("extra, prompt", [
    ({"add_generation_prompt": False}, ASKED),
    ({"messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True},
     ASKED + "assistant: The capital of France is"),
    ({"chat_template_kwargs": {"mood": "calm"}}, ASKED + "[calm]assistant:"),
    ({"messages": [{**QUESTION, "name": "ann"}]}, "user (ann): What is the capital of France?\nassistant:"),
])
async def test_tasks_carry_them_to_the_same_prompt(tokenizer, monkeypatch, extra, prompt):
    monkeypatch.setattr(tokenizer, "chat_template", NAMED_TEMPLATE)
    mesh = ScriptedMesh(tokenizer.encode(" Paris.", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        chat = await http.post("/v1/chat/completions", json={"messages": [QUESTION], **extra})
        task = await finished_task(http, {"messages": [QUESTION], **extra})
    assert chat.status_code == 200 and task["state"] == "TASK_STATE_SUCCEEDED"
    assert [tokenizer.decode(p) for p in mesh.prompts] == [prompt, prompt]
    assert task["choices"][0]["result"]["prompt_token_ids"] == mesh.prompts[0]
    assert task["choices"][0]["text"] == " Paris."


async def test_a_task_with_contradictory_options_is_refused_at_submit_with_the_routes_message(tokenizer):
    async with app_client(tokenizer) as http:
        r = await http.post("/v1/tasks", json={"messages": [QUESTION, PREFILL], "continue_final_message": True})
    assert (r.status_code, r.json()) == (400, error(
        "continue_final_message cannot be used with add_generation_prompt: true (set add_generation_prompt to "
        "false)", "continue_final_message"))
