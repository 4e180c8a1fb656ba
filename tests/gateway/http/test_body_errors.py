"""What the HTTP API answers a body it cannot take: the exact status and OpenAI error
body, saying what is wrong and naming the field as the body spells it (no type names
of pydantic's unions), on a gateway whose scheduler is unreachable (every refusal
here comes before any work)."""

from __future__ import annotations

import gzip
import json

import pytest
import pytest_asyncio
from pydantic import ValidationError

from gateway.http.errors import union_paths, validation_error
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tenants import TenantRegistry
from tests.support.served_gateway import served_gateway

JSON = {"content-type": "application/json"}
CHAT = [{"role": "user", "content": "Hi"}]


@pytest_asyncio.fixture
async def served():
    async with served_gateway() as served:
        yield served


def error(message: str, code: str | None = "invalid_value", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


async def post(client, path: str, content: bytes, headers: dict) -> tuple[int, dict]:
    resp = await client.post(path, content=content, headers=headers)
    return resp.status_code, resp.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/tasks"])
@pytest.mark.parametrize("content, headers, status, body", [
    (gzip.compress(b'{"prompt": "Hi"}', mtime=0), {**JSON, "content-encoding": "gzip"}, 415,
     error("Content-Encoding 'gzip' is not supported; send the body uncompressed", "unsupported_media_type")),
    (b'{"prompt": "Hi"}', {**JSON, "content-encoding": "identity, br"}, 415,
     error("Content-Encoding 'br' is not supported; send the body uncompressed", "unsupported_media_type")),
    (b'{"prompt": "Hi"}', {"content-type": "text/plain"}, 415,
     error("Content-Type must be application/json; got 'text/plain'", "unsupported_media_type")),
    (b'{"prompt": "Hi"}', {"content-type": "application/x-www-form-urlencoded"}, 415,  # curl -d without -H
     error("Content-Type must be application/json; got 'application/x-www-form-urlencoded'",
           "unsupported_media_type")),
    (b"", JSON, 400, error("the body is empty; send a JSON object")),
    (gzip.compress(b'{"prompt": "Hi"}', mtime=0), JSON, 400,  # mtime=0: a test id the same in every worker
     error("the body is not valid UTF-8: byte 0x8b at offset 1")),
    (b'{"prompt": "Hi\xff"}', JSON, 400, error("the body is not valid UTF-8: byte 0xff at offset 14")),
    (b'{"prompt": "Hi", "seed": ' + b"1" * 5000 + b"}", JSON, 400,
     error("the body holds an integer of more than 4300 digits")),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, 400,
     error("the body is not valid JSON: it is nested too deeply")),
    (b"{not json", JSON, 400,
     error("the body is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 2)")),
    (b'["Hi"]', JSON, 400, error("the body must be a JSON object, got an array")),
])
async def test_a_body_that_is_no_json_object_says_why(served, path, content, headers, status, body):
    client, _ = served
    assert await post(client, path, content, headers) == (status, body)


async def test_a_json_content_type_with_a_charset_or_a_json_suffix_or_none_at_all_is_json(served):
    """A body with no Content-Type is read as JSON, as FastAPI (and vLLM's server) reads it."""
    client, _ = served
    for headers in ({"content-type": "application/json; charset=utf-8"},
                    {"content-type": "application/vnd.api+json"}, {}):
        status, body = await post(client, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 0}', headers)
        assert (status, body["error"]["param"]) == (400, "max_tokens")  # read as JSON: judged by its fields


async def test_a_byte_order_mark_or_an_empty_content_type_is_read_as_json(served):
    """Found by a review: FastAPI's parsing took both, so clients that send them worked."""
    client, _ = served
    for content, headers in ((b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 0}', JSON),
                             (b'{"prompt": "Hi", "max_tokens": 0}', {"content-type": ""})):
        status, body = await post(client, "/v1/completions", content, headers)
        assert (status, body["error"]["param"]) == (400, "max_tokens")  # read as JSON: judged by its fields
    assert await post(client, "/v1/completions", b'\xef\xbb\xbf{"prompt": "Hi\xff"}', JSON) == \
        (400, error("the body is not valid UTF-8: byte 0xff at offset 17"))
    assert await post(client, "/v1/completions", b"\xef\xbb\xbf", JSON) == (
        400, error("the body is empty; send a JSON object"))


@pytest.mark.parametrize("path, fields, param, message", [
    ("/v1/completions", {"prompt": [True, False]}, "prompt",
     "prompt: Input should be a string, a list of strings, a list of token ids (integers) or a list of lists "
     "of token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt",
     "prompt: Input should be a string, a list of strings, a list of token ids (integers) or a list of lists "
     "of token ids"),
    ("/v1/completions", {"prompt": [[1, 2.0]]}, "prompt",
     "prompt: Input should be a string, a list of strings, a list of token ids (integers) or a list of lists "
     "of token ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4.0}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [True]}, "stop_token_ids.0",
     "stop_token_ids.0: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "Hi", "temperature": True}, "temperature",
     "temperature: Input should be a valid number"),
    ("/v1/completions", {"prompt": "Hi", "stop": [1]}, "stop.0", "stop.0: Input should be a valid string"),
    ("/v1/completions", {"prompt": "Hi", "stop": 1}, "stop", "stop: Input should be a string or a list of strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "messages.0.content: Input should be a string, a list of text parts or null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]},
     "messages.0.content.0.type", "messages.0.content.0.type: Field required"),
    ("/v1/chat/completions", {"messages": CHAT, "n": True}, "n", "n: Input should be a valid integer"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "true"}, "stream", "stream: Input should be a valid boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs",
     "logprobs: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo", "echo: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": "Hi", "ignore_eos": 0}, "ignore_eos", "ignore_eos: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": "false"}},
     "stream_options.include_usage", "stream_options.include_usage: Input should be a valid boolean"),
    ("/v1/tasks", {"prompt": "Hi", "return_token_ids": 1}, "return_token_ids",
     "return_token_ids: Input should be a valid boolean"),
    ("/v1/tasks", {"prompt": [True]}, "prompt",
     "prompt: Input should be a string, a list of strings, a list of token ids (integers) or a list of lists "
     "of token ids"),
    ("/v1/completions", {"prompt": "Hi", "user": "u" * 257}, "user", "user: String should have at most 256 characters"),
    ("/v1/tasks", {"prompt": "Hi", "user": "u" * 257}, "user", "user: String should have at most 256 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text", "messages.0.content.0.text: Input should be a valid string"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": 5}, "tool_choice",
     "tool_choice: Input should be a string or an object"),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": 5}, "function_call",
     "function_call: Input should be a string or an object"),
    ("/v1/tasks", {"prompt": {"text": "Hi"}}, "prompt",
     "prompt: Input should be a string, a list of strings, a list of token ids (integers) or a list of lists "
     "of token ids"),
])
async def test_a_field_of_the_wrong_type_is_named_as_the_body_spells_it(served, path, fields, param, message):
    client, _ = served
    assert await post(client, path, json.dumps(fields).encode(), JSON) == (400, error(message, param=param))


@pytest.mark.parametrize("path, fields, param, message", [
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt.1",
     "prompt[1] is not valid Unicode: a lone surrogate at character 0"),
    ("/v1/chat/completions", {"messages": [*CHAT, *CHAT, *CHAT, {"role": "user", "content": "ab\udfff"}]},
     "messages.3.content", "messages[3].content is not valid Unicode: a lone surrogate at character 2"),
    ("/v1/tasks", {"messages": [*CHAT, {"role": "user", "content": "\ud800"}]}, "messages.1.content",
     "messages[1].content is not valid Unicode: a lone surrogate at character 0"),
])
async def test_a_lone_surrogate_names_the_prompt_or_message_holding_it(served, path, fields, param, message):
    client, _ = served
    content = json.dumps(fields).encode()  # ASCII: the surrogate as \ud800
    assert await post(client, path, content, JSON) == (400, error(message, param=param))


@pytest.mark.parametrize("prompt, param, message", [
    ([[1, 2], [1_000_000_000]], "prompt.1.0", "prompt[1][0] = 1000000000 is outside the vocabulary [0, {vocab})"),
    ([[1, 2], []], "prompt.1", "prompt[1] must not be empty"),
    ([-1], "prompt.0", "prompt[0] = -1 is outside the vocabulary [0, {vocab})"),
    ([[5, -1]], "prompt.0.1", "prompt[0][1] = -1 is outside the vocabulary [0, {vocab})"),  # a list of one
    (["x " * 9000], "prompt.0", "prompt[0] has 9001 tokens; max_model_len is {max_len} (prompt + at least 1 output "
                                "token)"),
    (["ok", "x " * 9000], "prompt.1", "prompt[1] has 9001 tokens; max_model_len is {max_len} (prompt + at least "
                                      "1 output token)"),
    ("x " * 9000, "prompt", "prompt has 9001 tokens; max_model_len is {max_len} (prompt + at least 1 output token)"),
])
async def test_a_bad_prompt_of_a_completions_body_is_named_as_the_body_spells_it(served, prompt, param, message):
    """Found by a review: the core's ``prompt_token_ids[0]`` was named for a body that has
    no such field, and an error in one prompt of a list did not say which."""
    client, svc = served
    core = svc.servicer.core
    content = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    expected = message.format(vocab=core.prompts.vocab_size, max_len=core.model.max_model_len)
    assert await post(client, "/v1/completions", content, JSON) == (400, error(expected, param=param))


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}}),
])
async def test_stream_options_without_a_stream_is_refused_as_vllm_refuses_it(served, path, fields):
    client, _ = served
    assert await post(client, path, json.dumps(fields).encode(), JSON) == (400, error(
        "stream_options is only allowed with stream: true", param="stream_options"))


@pytest.mark.parametrize("prompt, param, message", [
    ([5, -1], "prompt.1", "prompt[1] = -1 is outside the vocabulary [0, 49152)"),
    ([[5, -1]], "prompt.0.1", "prompt[0][1] = -1 is outside the vocabulary [0, 49152)"),
])
async def test_a_tasks_token_prompt_is_named_as_the_body_spells_it(served, prompt, param, message):
    client, _ = served
    content = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert await post(client, "/v1/tasks", content, JSON) == (400, error(message, param=param))


async def test_a_task_with_both_messages_and_prompt_is_refused_naming_prompt(served):
    client, _ = served
    content = json.dumps({"messages": CHAT, "prompt": "Hi"}).encode()
    assert await post(client, "/v1/tasks", content, JSON) == (400, error(
        "prompt and messages cannot both be set: a task is a chat (messages) or a completion (prompt)",
        param="prompt"))


async def test_a_null_messages_in_a_task_is_absent(served):
    client, _ = served
    resp = await client.post("/v1/tasks", json={"messages": None, "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 202, resp.text
    resp = await client.post("/v1/tasks", json={"messages": CHAT, "prompt": None, "max_tokens": 2})
    assert resp.status_code == 202, resp.text


@pytest.mark.parametrize("fields", [
    {"prompt": [1, 2, 3]}, {"prompt": [[1], [2, 3]]}, {"prompt": ["a", "b"]}, {"prompt": "a", "temperature": 1},
    {"prompt": "a", "max_tokens": 4, "seed": 2**40, "stop_token_ids": [7], "user": "u" * 256},
])
def test_what_openai_and_vllm_both_take_is_still_taken(fields):
    CompletionRequest.model_validate(fields)


def test_a_union_error_inside_a_content_part_keeps_its_detail():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": 5, "text": "x"}]}]})
    e = validation_error(info.value.errors())
    assert (e.status, e.message, e.param) == (400, "messages.0.content.0.type: Input should be a valid string",
                                              "messages.0.content.0.type")


def test_a_dict_key_in_a_location_is_kept():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": True}})
    e = validation_error(info.value.errors())
    assert (e.message, e.param) == ("logit_bias.1: Input should be a valid number", "logit_bias.1")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/tasks"])
@pytest.mark.parametrize("key", ["Abc", "a-b", "str", "int", "list[int]", "ContentPart", "body", "x[0]"])
async def test_a_logit_bias_key_that_looks_like_a_type_name_is_named_as_a_key(served, path, key):
    """Pydantic names a union's members in its error locations (``str``, ``list[int]``);
    a dict key spelled like one is still the caller's key, in ``param`` and the message."""
    client, _ = served
    fields = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    content = json.dumps({**fields, "logit_bias": {key: "x"}}).encode()
    assert await post(client, path, content, JSON) == (
        400, error(f"logit_bias.{key}: Input should be a valid number", param=f"logit_bias.{key}"))


def test_the_union_fields_are_found_from_the_body_models():
    """Where pydantic names union members: right after these fields (``|``: inside a
    member), never after a dict's key, nor after ``X | None`` (nullable, no member name)."""
    from typing import Any

    from pydantic import BaseModel

    class Inner(BaseModel):
        x: int | str
        y: str | None = None

    class Outer(BaseModel):
        a: list[Inner | int]
        d: dict[str, int | str]
        n: Inner | None = None
        free: Any = None

    assert union_paths(Outer) == {"a", "a.|.x", "n.x"}
    assert union_paths(ChatCompletionRequest) | union_paths(CompletionRequest) == {
        "prompt", "stop", "messages.content", "tool_choice", "function_call", "structured_outputs.json"}


def test_a_null_inside_stream_options_is_its_default_as_at_the_top_level():
    body = CompletionRequest.model_validate({"prompt": "a", "stream": True, "n": None,
                                             "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
    assert (body.n, body.stream_options.include_usage, body.stream_options.continuous_usage_stats) == (1, False, False)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": -5}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": -5}),
])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer no-such-key"}])
async def test_a_completion_without_a_valid_key_is_401_before_its_fields_are_judged(tmp_path, path, body, headers):
    """As ``POST /v1/tasks``: a caller without a valid key learns nothing of the body's
    fields (OpenAI's and vLLM's servers check the key first); with the key, the bad
    field is the 400 naming it."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "acme"\napi_keys = ["key-acme"]\n')
    async with served_gateway(tenants=TenantRegistry.from_file(tenants)) as (client, _):
        resp = await client.post(path, json=body, headers=headers)
        assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_api_key")
        resp = await client.post(path, json=body, headers={"authorization": "Bearer key-acme"})
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, "temperature")
