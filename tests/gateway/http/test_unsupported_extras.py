"""vLLM's extras meshserve does not implement (``gateway.http.unsupported.VLLM_EXTRAS``)
are refused with a 400 naming the field when they ask for anything meshserve does not
do, never ignored; their defaults (and null) pass, as other unknown fields do."""

from __future__ import annotations

import pytest

from gateway.http.convert import chat_request, completion_requests
from gateway.http.errors import http_error
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.http.unsupported import VLLM_EXTRAS
from meshserve.errors import InvalidArgument
from tests.support.inprocess_app import ScriptedMesh, app_client

CHAT = [{"role": "user", "content": "Hi"}]


def build(route: str, **fields):
    """The route's body with ``fields``, converted as the route converts it."""
    if route == "chat":
        return chat_request(ChatCompletionRequest.model_validate({"messages": CHAT, **fields}), 1024, "r")
    return completion_requests(CompletionRequest.model_validate({"prompt": "Hi", **fields}), "r")


def other_value(allowed: tuple):
    """A value that asks for more than ``allowed`` does."""
    if not allowed:
        return {"type": "object"}
    default = allowed[0]
    if isinstance(default, bool):
        return not default
    return {float: 2.0, list: ["bad"], dict: {"type": "json_object"}}[type(default)]


def routes_of(extra) -> list[str]:
    return ["chat", "completions"] if extra.routes == "both" else [extra.routes]


CASES = [(route, extra) for extra in VLLM_EXTRAS for route in routes_of(extra)]


@pytest.mark.parametrize("route, extra", CASES, ids=[f"{r}-{e.name}" for r, e in CASES])
def test_each_extra_is_refused_naming_it_and_its_default_passes(route, extra):
    with pytest.raises(InvalidArgument) as err:
        build(route, **{extra.name: other_value(extra.allowed)})
    only = f"; only {extra.name}: " if extra.allowed else ""
    assert str(err.value).startswith(f"{extra.name} is not supported ({extra.what}){only}")
    assert http_error(err.value).param == extra.name
    build(route, **{extra.name: None})  # null is the default
    for value in extra.allowed:
        build(route, **{extra.name: value})


@pytest.mark.parametrize("route, fields, message", [
    ("chat", {"guided_json": {"type": "object"}},
     "guided_json is not supported (vLLM's older guided decoding; use structured_outputs or response_format)"),
    ("completions", {"guided_choice": ["yes", "no"]},
     "guided_choice is not supported (vLLM's older guided decoding; use structured_outputs or response_format)"),
    ("completions", {"structural_tag": "{}"}, "structural_tag is not supported (structural tags)"),
    ("chat", {"use_beam_search": True, "n": 2},
     "use_beam_search is not supported (beam search); only use_beam_search: false is served"),
    ("completions", {"skip_special_tokens": 1},  # a boolean only as itself
     "skip_special_tokens is not supported (special tokens are always skipped from the text); only "
     "skip_special_tokens: true is served"),
    ("chat", {"add_special_tokens": True},
     "add_special_tokens is not supported (the chat template alone adds special tokens); only "
     "add_special_tokens: false is served"),
    ("completions", {"add_special_tokens": False},
     "add_special_tokens is not supported (a raw prompt gets the tokenizer's special tokens); only "
     "add_special_tokens: true is served"),
    ("chat", {"kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params is not supported (disaggregated prefill: KV transfer between instances)"),
    ("completions", {"kv_transfer_params": {}},
     "kv_transfer_params is not supported (disaggregated prefill: KV transfer between instances)"),
    ("chat", {"mm_processor_kwargs": {"num_crops": 4}},
     "mm_processor_kwargs is not supported (multimodal processing: meshserve serves text only)"),
])
def test_exact_messages(route, fields, message):
    with pytest.raises(InvalidArgument) as err:
        build(route, **fields)
    assert str(err.value) == message


def test_defaults_and_other_unknown_fields_pass():
    assert build("chat", use_beam_search=False, length_penalty=1, bad_words=[], skip_special_tokens=True,
                 add_special_tokens=False, echo=False, store=True, metadata={"a": "b"}).chat == (("user", "Hi"),)
    assert build("completions", add_special_tokens=True, response_format={"type": "text"},
                 spaces_between_special_tokens=True, parallel_tool_calls=True)[0].prompt == "Hi"


@pytest.mark.parametrize("field, value, what", [
    ("kv_transfer_params", {"do_remote_prefill": True}, "disaggregated prefill: KV transfer between instances"),
    ("mm_processor_kwargs", {"num_crops": 4}, "multimodal processing: meshserve serves text only"),
])
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Hi"}),
])
async def test_kv_transfer_and_multimodal_arguments_are_a_400_naming_them(tokenizer, path, body, field, value,
                                                                         what):
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        refused = await http.post(path, json={**body, field: value})
        served = await http.post(path, json={**body, field: None, "max_tokens": 1})
    assert (refused.status_code, refused.json()) == (400, {"error": {
        "message": f"{field} is not supported ({what})", "type": "invalid_request_error", "param": field,
        "code": "invalid_value"}})
    assert served.status_code == 200  # null is the default
    assert len(mesh.prompts) == 1  # the refused one never ran


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/tasks", {"messages": CHAT}),
])
async def test_the_routes_answer_400_naming_the_field(tokenizer, path, body):
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(path, json={**body, "guided_regex": "[a-z]+"})
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "guided_regex is not supported (vLLM's older guided decoding; use structured_outputs or "
                   "response_format)",
        "type": "invalid_request_error", "param": "guided_regex", "code": "invalid_value"}})
    assert mesh.prompts == []  # refused before anything ran


async def test_a_chat_best_of_other_than_n_is_a_400_and_one_equal_to_n_is_served(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        refused = await http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "best_of": 4})
        not_an_integer = await http.post("/v1/chat/completions", json={"messages": CHAT, "best_of": True})
        served = await http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "best_of": 2,
                                                               "max_tokens": 1})
    assert (refused.status_code, refused.json()) == (400, {"error": {
        "message": "best_of must equal n (meshserve returns every choice it generates)",
        "type": "invalid_request_error", "param": "best_of", "code": "invalid_value"}})
    assert (not_an_integer.status_code, not_an_integer.json()["error"]["param"]) == (400, "best_of")
    assert served.status_code == 200 and len(served.json()["choices"]) == 2
    assert len(mesh.prompts) == 1
