"""The gRPC ``GenerateRequest``'s chat options (``ChatMessages.add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``ChatMessage.name``) and its
``include_stop_str_in_output``: the same prompt ids as the HTTP chat route for the same
options (transformers' own ids), today's prompt when unset, and INVALID_ARGUMENT with the
message of the route's 400 for the same mistake."""

from __future__ import annotations

import json

import grpc
import pytest

from meshserve.v1 import gateway_pb2
from tests.support.inprocess_app import ScriptedMesh, gateway_clients

QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}
# a template that shows names, one variable and the generation prompt
NAMED_TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n"
                  "{% endfor %}{% if mood %}[{{ mood }}]{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


def hf(tokenizer, messages, **kwargs) -> list[int]:
    """transformers' own ids for the same messages and arguments."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def grpc_request(messages: list[dict], **options) -> gateway_pb2.GenerateRequest:
    """A chat ``GenerateRequest`` of ``messages`` (each with its ``name`` when it has one)."""
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in messages], **options)
    return gateway_pb2.GenerateRequest(chat=chat)


async def generate(stub, request: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateResponse]:
    return [msg async for msg in stub.Generate(request)]


# (HTTP body fields, the same as gRPC ChatMessages fields, transformers' arguments); no names: the default template
SAME_OPTIONS = [
    ({"messages": [QUESTION]}, {}, {"add_generation_prompt": True}),  # unset: today's prompt
    ({"messages": [QUESTION], "add_generation_prompt": False}, {"add_generation_prompt": False}, {}),
    ({"messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True},
     {"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True}),
]


@pytest.mark.parametrize("body, options, hf_kwargs", SAME_OPTIONS)
async def test_grpc_and_http_send_the_executor_the_same_prompt_ids(tokenizer, body, options, hf_kwargs):
    mesh = ScriptedMesh(tokenizer.encode(" Paris.", add_special_tokens=False))
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        r = await http.post("/v1/chat/completions", json=body)
        responses = await generate(stub, grpc_request(body["messages"], **options))
    want = hf(tokenizer, body["messages"], **hf_kwargs)
    assert r.status_code == 200 and mesh.prompts == [want, want]
    assert list(responses[-1].result.prompt_token_ids) == want
    assert len(want) == {(): 37, ("add_generation_prompt",): 33,
                         ("add_generation_prompt", "continue_final_message"): 42}[tuple(options)]


async def test_names_and_template_kwargs_reach_the_template_over_grpc_as_over_http(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", NAMED_TEMPLATE)
    mesh = ScriptedMesh(tokenizer.encode(" Paris.", add_special_tokens=False))
    named = [{**QUESTION, "name": "ann"}, {**PREFILL, "name": ""}, {"role": "user", "content": "Go on"}]
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        r = await http.post("/v1/chat/completions", json={"messages": named, "chat_template_kwargs": {"mood": 2}})
        await generate(stub, grpc_request(named, chat_template_kwargs='{"mood": 2}'))
    want = hf(tokenizer, named, add_generation_prompt=True, mood=2)
    assert r.status_code == 200 and mesh.prompts == [want, want]
    assert tokenizer.decode(want) == ("user (ann): What is the capital of France?\nassistant: The capital of France "
                                      "is\nuser: Go on\n[2]assistant:")  # 2, not 2.0: the JSON's own number


DEEP = json.loads("[" * 32 + "]" * 32)  # under an object: 33 levels


@pytest.mark.parametrize("body, request_, message", [
    ({"messages": [QUESTION, PREFILL], "continue_final_message": True},
     grpc_request([QUESTION, PREFILL], continue_final_message=True),
     "continue_final_message cannot be used with add_generation_prompt: true (set add_generation_prompt to false)"),
    ({"messages": [PREFILL, QUESTION], "add_generation_prompt": False, "continue_final_message": True},
     grpc_request([PREFILL, QUESTION], add_generation_prompt=False, continue_final_message=True),
     "continue_final_message needs the last message to be the assistant's, got role 'user'"),
    ({"messages": [QUESTION], "chat_template_kwargs": {"tokenize": False}},
     grpc_request([QUESTION], chat_template_kwargs='{"tokenize": false}'),
     "chat_template_kwargs.tokenize is not a template variable meshserve passes on (it is a parameter of the "
     "rendering itself, or the messages)"),
    ({"messages": [QUESTION], "chat_template_kwargs": [1]}, grpc_request([QUESTION], chat_template_kwargs="[1]"),
     "chat_template_kwargs: Input should be an object"),
    ({"messages": [QUESTION], "chat_template_kwargs": {"a": DEEP}},
     grpc_request([QUESTION], chat_template_kwargs=json.dumps({"a": DEEP})),
     "chat_template_kwargs: nests deeper than 32 levels of objects and arrays"),
])
async def test_bad_options_are_invalid_argument_with_the_routes_message(tokenizer, body, request_, message):
    mesh = ScriptedMesh(())
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        r = await http.post("/v1/chat/completions", json=body)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, request_)
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert mesh.prompts == []


async def test_template_kwargs_that_are_not_json_are_invalid_argument_naming_them(tokenizer):
    async with gateway_clients(tokenizer) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, grpc_request([QUESTION], chat_template_kwargs='{"mood": calm}'))
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "chat_template_kwargs is not valid JSON: Expecting value (line 1, column 10)")


OUTPUT = "The answer is 42. Done here"  # tokens: The| answer| is| |4|2|.| Done| here


@pytest.mark.parametrize("include, text", [(True, "The answer is 42."), (False, "The answer is 42")])
async def test_include_stop_str_in_output_over_grpc_returns_the_stop_string(tokenizer, include, text):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    request = gateway_pb2.GenerateRequest(prompt="Q:", include_stop_str_in_output=include)
    request.sampling.stop.append(".")
    request.sampling.max_tokens = 9
    async with gateway_clients(tokenizer, mesh) as (_, stub):
        responses = await generate(stub, request)
    deltas = [m.delta for m in responses if m.HasField("delta")]
    result = responses[-1].result
    assert "".join(d.text for d in deltas) == text
    assert (result.finish_reason, result.stop_reason, result.usage.completion_tokens) == (1, ".", 7)
    assert sum(len(d.token_ids) for d in deltas) == 7
    if include:  # one delta of its own, with no token ids, right before the result
        assert (deltas[-1].text, list(deltas[-1].token_ids)) == (".", [])
        assert responses[-2].delta == deltas[-1]


@pytest.mark.parametrize("kwargs, message", [
    ('{"mood": "\\ud800"}', "chat_template_kwargs is not valid Unicode: a lone surrogate at character 10"),
    ('{"\\udfff": 1, "a": "ok"}', "chat_template_kwargs is not valid Unicode: a lone surrogate at character 13"),
])
async def test_template_kwargs_with_a_lone_surrogate_escape_are_refused_as_the_http_route_refuses_them(
        tokenizer, monkeypatch, kwargs, message):
    # JSON text can spell a lone surrogate as an escape, which proto's UTF-8 check lets through; the HTTP
    # route refuses the same object with this message (its character: in the object's sorted JSON)
    monkeypatch.setattr(tokenizer, "chat_template", NAMED_TEMPLATE)
    mesh = ScriptedMesh(())
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        r = await http.post("/v1/chat/completions", content=json.dumps({"messages": [QUESTION],
                                                                        "chat_template_kwargs": json.loads(kwargs)}),
                            headers={"content-type": "application/json"})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, grpc_request([QUESTION], chat_template_kwargs=kwargs))
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert mesh.prompts == []
