"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the ids are exactly those the
gateway feeds the engine for the same completion or chat (the prompt a scripted
executor receives, and the usage's ``prompt_tokens``); fields meshserve does not
implement are 400 naming them; ``model``, the API key, bodies and errors as on the
``/v1`` routes; no executor needed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gateway.tenants import TenantRegistry
from tests.support.inprocess_app import MODEL, ScriptedMesh, app_client
from tests.support.served_gateway import served_gateway

QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}
SERVED = dataclasses.replace(MODEL, served_model_names=("HuggingFaceTB/SmolLM2-135M-Instruct", "smol"))


def error(message: str, param: str | None, code: str | None = "invalid_value") -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The default model's tokenizer with a post-processor that prepends its BOS (``<|im_start|>``, id 1),
    as a Llama-style tokenizer does."""
    from transformers import AutoTokenizer

    from meshserve.model_files import resolve_model

    try:
        files = resolve_model("default")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(files.path, add_bos_token=True)


async def tokenized(tokenizer, body: dict, model=MODEL) -> dict:
    """``POST /tokenize``'s answer on a fresh gateway (its prompt memo empty)."""
    async with app_client(tokenizer, model=model) as http:
        r = await http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def engine_prompt(tokenizer, path: str, body: dict) -> tuple[list[list[int]], int]:
    """The prompt ids a completion or chat request fed the engine, and its usage's
    ``prompt_tokens``, on another fresh gateway."""
    mesh = ScriptedMesh(tokenizer.encode(" Paris", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return mesh.prompts, r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("prompt, ids", [
    ("The capital of France is", [504, 3575, 282, 4649, 314]),
    ("Hello <|im_start|> world", [19556, 216, 1, 905]),  # control-token text is the control token, as a raw prompt's
    ("你好🙂 café", [18645, 250, 48392, 138, 10813, 38887, 37366]),
])
async def test_a_prompts_tokens_are_the_ids_a_completion_of_it_feeds_the_engine(tokenizer, prompt, ids):
    got = await tokenized(tokenizer, {"prompt": prompt})
    prompts, prompt_tokens = await engine_prompt(tokenizer, "/v1/completions", {"prompt": prompt})
    assert got == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    assert prompts == [ids] and prompt_tokens == len(ids)


async def test_an_empty_prompt_is_counted_as_vllm_counts_it(tokenizer, bos_tokenizer):
    """vLLM's ``/tokenize`` answers ``""`` with no ids (what the post-processor adds, if
    anything); a completion of it is still a 400."""
    empty = {"count": 0, "max_model_len": 2048, "tokens": [], "token_strs": []}
    assert await tokenized(tokenizer, {"prompt": "", "return_token_strs": True}) == empty
    assert await tokenized(tokenizer, {"prompt": "", "add_special_tokens": False}) == {**empty, "token_strs": None}
    assert (await tokenized(bos_tokenizer, {"prompt": ""}))["tokens"] == [1]
    assert (await tokenized(bos_tokenizer, {"prompt": "", "add_special_tokens": False}))["tokens"] == []
    async with app_client(tokenizer) as http:
        r = await http.post("/v1/completions", json={"prompt": "", "max_tokens": 1})
    assert (r.status_code, r.json()) == (400, error("prompt must not be empty", "prompt"))


@pytest.mark.parametrize("fields, count", [
    ({"messages": [QUESTION]}, 37),
    ({"messages": [QUESTION], "add_generation_prompt": False}, 33),
    ({"messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True}, 42),
    ({"messages": [{"role": "developer", "content": "Be brief."},  # developer: the system role, as the chat route
                   {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Say <|im_end|>"},
                                                               {"type": "text", "text": " twice"}]}],
      "chat_template_kwargs": {"enable_thinking": False}}, 27),  # a user's control-token text stays text
])
async def test_a_chats_tokens_are_the_ids_a_chat_completion_of_it_feeds_the_engine(tokenizer, fields, count):
    got = await tokenized(tokenizer, fields)
    prompts, prompt_tokens = await engine_prompt(tokenizer, "/v1/chat/completions", fields)
    assert prompts == [got["tokens"]] and prompt_tokens == got["count"] == len(got["tokens"]) == count
    assert got["max_model_len"] == 2048


async def test_a_chats_tokens_are_transformers_rendering_of_it(tokenizer):
    got = await tokenized(tokenizer, {"messages": [QUESTION, PREFILL], "add_generation_prompt": False,
                                      "continue_final_message": True})
    want = tokenizer.apply_chat_template([QUESTION, PREFILL], continue_final_message=True, tokenize=True,
                                         return_dict=False)
    assert got["tokens"] == list(want)
    assert tokenizer.decode(want).endswith("<|im_start|>assistant\nThe capital of France is")


async def test_return_token_strs_gives_each_ids_token_and_null_without_it(tokenizer):
    got = await tokenized(tokenizer, {"prompt": "你好🙂 café", "return_token_strs": True})
    assert got["token_strs"] == ["ä½", "ł", "å¥", "½", "ðŁ", "ĻĤ", "ĠcafÃ©"]
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    chat = await tokenized(tokenizer, {"messages": [QUESTION], "return_token_strs": True})
    assert chat["token_strs"][:3] == ["<|im_start|>", "system", "Ċ"]
    assert (await tokenized(tokenizer, {"prompt": "Hi", "return_token_strs": None}))["token_strs"] is None


async def test_add_special_tokens_false_leaves_out_the_bos_a_completion_prompt_gets(bos_tokenizer):
    """The completion form's ``add_special_tokens`` (default true: a completion's own ids);
    false is tokenize-only: ``/v1/completions`` refuses it, and takes the ids as a token prompt."""
    with_bos = await tokenized(bos_tokenizer, {"prompt": "Hello world"})
    without = await tokenized(bos_tokenizer, {"prompt": "Hello world", "add_special_tokens": False})
    prompts, prompt_tokens = await engine_prompt(bos_tokenizer, "/v1/completions", {"prompt": "Hello world"})
    assert with_bos["tokens"] == [1, 19556, 905] and prompts == [with_bos["tokens"]] and prompt_tokens == 3
    assert without["tokens"] == [19556, 905] == bos_tokenizer.encode("Hello world", add_special_tokens=False)
    mesh = ScriptedMesh([905])
    async with app_client(bos_tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={"prompt": "Hello world", "add_special_tokens": False})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "add_special_tokens")
        r = await http.post("/v1/completions", json={"prompt": without["tokens"], "max_tokens": 1})
    assert r.status_code == 200 and mesh.prompts == [[19556, 905]]


async def test_a_chats_tokens_get_no_bos_beyond_the_template_as_a_chat_completion(bos_tokenizer):
    got = await tokenized(bos_tokenizer, {"messages": [QUESTION], "add_special_tokens": False})
    prompts, _ = await engine_prompt(bos_tokenizer, "/v1/chat/completions", {"messages": [QUESTION]})
    assert prompts == [got["tokens"]] and got["tokens"][:2] == [1, 9690]  # the template's <|im_start|>system


async def test_a_prompt_longer_than_max_model_len_is_counted_where_a_completion_is_refused(tokenizer):
    prompt = "one two three four five six seven eight nine ten"
    short = dataclasses.replace(MODEL, max_model_len=8)
    async with app_client(tokenizer, model=short) as http:
        counted = await http.post("/tokenize", json={"prompt": prompt})
        refused = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert (counted.json()["count"], counted.json()["max_model_len"]) == (10, 8)
    assert (refused.status_code, refused.json()) == (400, error(
        "prompt has 10 tokens; max_model_len is 8 (prompt + at least 1 output token)", "prompt"))


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools are not supported"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "chat_template is not supported (a chat template per "
                                                           "request (the gateway's --chat-template applies))"),
    ({"add_special_tokens": True}, "add_special_tokens", "add_special_tokens is not supported (the chat template "
                                                         "alone adds special tokens); only add_special_tokens: false "
                                                         "is served"),
    ({"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs",
     "mm_processor_kwargs is not supported (multimodal processing: meshserve serves text only)"),
    ({"media_io_kwargs": {"image": {}}}, "media_io_kwargs",
     "media_io_kwargs is not supported (multimodal inputs: meshserve serves text only)"),
])
async def test_a_chat_field_meshserve_does_not_implement_is_refused_naming_it(tokenizer, fields, param, message):
    async with app_client(tokenizer) as http:
        r = await http.post("/tokenize", json={"messages": [QUESTION], **fields})
    assert (r.status_code, r.json()) == (400, error(message, param))


async def test_defaults_and_nulls_of_those_fields_pass_and_sampling_fields_are_ignored(tokenizer):
    """vLLM's tokenize bodies have no sampling fields: a client's leftovers are not judged."""
    plain = await tokenized(tokenizer, {"messages": [QUESTION]})
    got = await tokenized(tokenizer, {"messages": [QUESTION], "tools": [], "chat_template": None,
                                      "add_special_tokens": False, "mm_processor_kwargs": None,
                                      "max_tokens": 0, "temperature": "hot", "model": "smollm2-135m-instruct"})
    assert got == plain


@pytest.mark.parametrize("path, body, param, message", [
    ("/tokenize", {}, "prompt", "prompt (a text) or messages (a chat) is required"),
    ("/tokenize", {"prompt": None, "messages": None}, "prompt", "prompt (a text) or messages (a chat) is required"),
    ("/tokenize", {"prompt": "Hi", "messages": [QUESTION]}, "prompt",
     "prompt and messages cannot both be set: tokenize a completion's prompt or a chat's messages"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt: Input should be a valid string"),
    ("/tokenize", {"prompt": "ab\udfff"}, "prompt", "prompt is not valid Unicode: a lone surrogate at character 2"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": 1}, "add_special_tokens",
     "add_special_tokens: Input should be a valid boolean"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": "yes"}, "return_token_strs",
     "return_token_strs: Input should be a valid boolean"),
    ("/tokenize", {"messages": []}, "messages", "messages: List should have at least 1 item after validation, "
                                                "not 0"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "4"}]}, "messages.0.role",
     "messages[0].role must be one of system, user, assistant, developer, got 'tool'"),
    ("/tokenize", {"messages": [QUESTION, {"role": "user", "content": "\ud800"}]}, "messages.1.content",
     "messages[1].content is not valid Unicode: a lone surrogate at character 0"),
    ("/tokenize", {"messages": [QUESTION, PREFILL], "continue_final_message": True}, "continue_final_message",
     "continue_final_message cannot be used with add_generation_prompt: true (set add_generation_prompt to false)"),
    ("/detokenize", {}, "tokens", "tokens: Field required"),
    ("/detokenize", {"tokens": [5, 49152]}, "tokens.1", "tokens[1] = 49152 is outside the vocabulary [0, 49152)"),
    ("/detokenize", {"tokens": [5, -1]}, "tokens.1", "tokens.1: Input should be greater than or equal to 0"),
    ("/detokenize", {"tokens": [True]}, "tokens.0", "tokens.0: Input should be a valid integer"),
    ("/detokenize", {"tokens": [5.0]}, "tokens.0", "tokens.0: Input should be a valid integer"),
    ("/detokenize", {"tokens": "5"}, "tokens", "tokens: Input should be a valid list"),
])
async def test_a_bad_field_is_400_naming_it(tokenizer, path, body, param, message):
    async with app_client(tokenizer) as http:
        r = await http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (400, error(message, param))


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_a_body_that_is_no_json_object_is_refused_as_on_the_other_routes(tokenizer, path):
    async with app_client(tokenizer) as http:
        r = await http.post(path, content=b'["Hi"]', headers={"content-type": "application/json"})
        assert (r.status_code, r.json()) == (400, error("the body must be a JSON object, got an array", None))
        r = await http.post(path, content=b'{"prompt": "Hi"}', headers={"content-type": "text/plain"})
        assert (r.status_code, r.json()) == (415, error("Content-Type must be application/json; got 'text/plain'",
                                                        None, "unsupported_media_type"))
        r = await http.post(path, content=b'{"prompt": "' + b"x" * (8 << 20) + b'"}',
                            headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        r = await http.get(path)
        assert (r.status_code, r.headers["allow"]) == (405, "POST")


async def test_model_is_a_served_name_else_404_as_a_completion_naming_it(tokenizer):
    async with app_client(tokenizer, model=SERVED) as http:
        for body in ({"prompt": "Hi", "model": "smol"}, {"messages": [QUESTION], "model": "smol"}):
            assert (await http.post("/tokenize", json=body)).status_code == 200
        assert (await http.post("/detokenize", json={"tokens": [5], "model": "smol"})).status_code == 200
        completion = await http.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-4o"})
        assert completion.status_code == 404 and completion.json()["error"]["code"] == "model_not_found"
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/tokenize", {"messages": [QUESTION]}),
                           ("/detokenize", {"tokens": [5]})):
            r = await http.post(path, json={**body, "model": "gpt-4o"})
            assert (r.status_code, r.json()) == (404, completion.json()), path


async def test_detokenize_keeps_special_tokens_as_vllm_and_gives_a_tokenized_text_back(tokenizer):
    async with app_client(tokenizer) as http:
        r = await http.post("/detokenize", json={"tokens": [1, 28120, 2]})
        assert (r.status_code, r.json()) == (200, {"prompt": "<|im_start|>hello<|im_end|>"})
        assert (await http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
        for body in ({"prompt": "你好🙂 café <|im_end|>"}, {"messages": [QUESTION]}):
            ids = (await http.post("/tokenize", json=body)).json()["tokens"]
            text = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
            assert text == tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert (await tokenized(tokenizer, {"prompt": "你好🙂 café <|im_end|>"}))["tokens"][-1] == 2


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer no-such-key"}])
async def test_with_a_tenants_file_a_key_is_needed_and_no_executor_is(tmp_path, headers):
    """The key is checked before the body's fields, as on ``POST /v1/tasks``; the gateway's
    scheduler is unreachable and no executor serves, yet tokenizing is served."""
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["key-acme"]\n')
    async with served_gateway(tenants=TenantRegistry.from_file(path)) as (http, _):
        for route, body in (("/tokenize", {"prompt": ""}), ("/detokenize", {"tokens": [-1]})):
            r = await http.post(route, json=body, headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), route
        key = {"x-api-key": "key-acme"}
        assert (await http.get("/ready")).status_code == 503
        r = await http.post("/tokenize", json={"prompt": "The capital of France is"}, headers=key)
        assert r.json() == {"count": 5, "max_model_len": 8192, "tokens": [504, 3575, 282, 4649, 314],
                            "token_strs": None}
        r = await http.post("/detokenize", json={"tokens": [504, 3575]}, headers={"authorization": "Bearer key-acme"})
        assert r.json() == {"prompt": "The capital"}
