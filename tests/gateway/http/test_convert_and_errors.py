"""The HTTP adapter's pure parts, without a mesh: OpenAI bodies → ``GenerationRequest``
and domain errors → OpenAI's error shape and status."""

import hashlib

import grpc
import pytest
from pydantic import ValidationError

from gateway.http.convert import chat_request, completion_requests
from gateway.http.errors import http_error, validation_error
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from meshserve.errors import (AlreadyExists, InvalidArgument, MeshError, ModelNotFound, NotFound, ResourceExhausted,
                              Unauthenticated, Unavailable)
from meshserve.request_ids import MAX_REQUEST_ID_LEN
from meshserve.sampling import SamplingParams

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                                {"type": "text", "text": "!"}]}]


def test_chat_fields_map_to_sampling_params():
    body = ChatCompletionRequest(messages=CHAT, model="smol", n=2, seed=3, stop="END", temperature=0.5, top_p=0.9,
                                 presence_penalty=0.1, frequency_penalty=0.2, logprobs=True, top_logprobs=4,
                                 top_k=5, min_p=0.1, min_tokens=2, repetition_penalty=1.1, ignore_eos=True,
                                 stop_token_ids=[7], priority=2, max_tokens=50, max_completion_tokens=9)
    r = chat_request(body, max_model_len=1024, request_id="r1")
    assert r.chat == (("system", "Be brief."), ("user", "Hi!"))
    assert (r.model, r.priority, r.request_id) == ("smol", 2, "r1")
    assert r.sampling == SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=("END",),
                                        stop_token_ids=(7,), ignore_eos=True, min_p=0.1, repetition_penalty=1.1,
                                        presence_penalty=0.1, frequency_penalty=0.2, min_tokens=2, n=2, logprobs=4)


def test_logit_bias_keys_become_token_ids_in_the_bodys_order():
    body = CompletionRequest(prompt="x", logit_bias={"50256": -100, "0": 2.5, "-4": 1.0})
    assert completion_requests(body, "r")[0].sampling.logit_bias == ((50256, -100.0), (0, 2.5), (-4, 1.0))
    chat = ChatCompletionRequest(messages=CHAT, logit_bias={"7": 0.5})
    assert chat_request(chat, max_model_len=64, request_id="r").sampling.logit_bias == ((7, 0.5),)
    for none in (None, {}):
        assert completion_requests(CompletionRequest(prompt="x", logit_bias=none), "r")[0].sampling.logit_bias == ()
    for key in ("x1", " 1", "1.0", "05", "-0", "+1", "1_000", "\u0661", "1" * 19):  # int() takes some of them
        with pytest.raises(InvalidArgument) as err:
            completion_requests(CompletionRequest(prompt="x", logit_bias={key: 1.0}), "r")
        assert str(err.value).startswith(f"logit_bias: key {key!r} is not a token id")
        assert http_error(err.value).param == "logit_bias"


def test_chat_without_a_cap_may_run_to_the_context_and_completions_default_to_16():
    assert chat_request(ChatCompletionRequest(messages=CHAT), 1024, "r").sampling.max_tokens == 1024
    assert completion_requests(CompletionRequest(prompt="Hi"), "r")[0].sampling.max_tokens == 16


def test_completion_prompts_of_every_form():
    assert [(r.prompt, r.prompt_token_ids, r.request_id) for r in completion_requests(
        CompletionRequest(prompt=["a", "b"]), "r")] == [("a", None, "r-0"), ("b", None, "r-1")]
    assert completion_requests(CompletionRequest(prompt=[1, 2, 3]), "r")[0].prompt_token_ids == (1, 2, 3)
    long_id = "r" * MAX_REQUEST_ID_LEN  # valid: each prompt's id is cut to fit, never refused as the caller's
    digest = hashlib.sha256(long_id.encode()).hexdigest()[:16]
    assert [r.request_id for r in completion_requests(CompletionRequest(prompt=["a", "b"]), long_id)] == [
        long_id[: MAX_REQUEST_ID_LEN - 19] + f"~{digest}-{i}" for i in range(2)]
    with pytest.raises(InvalidArgument, match="request_id has 257 characters; the limit is 256"):
        completion_requests(CompletionRequest(prompt=["a", "b"]), "r" * 257)
    assert [r.prompt_token_ids for r in completion_requests(CompletionRequest(prompt=[[1], [2, 3]]), "r")] == \
        [(1,), (2, 3)]
    assert completion_requests(CompletionRequest(prompt="x", logprobs=0), "r")[0].sampling.logprobs == 0


@pytest.mark.parametrize("body,field", [
    (CompletionRequest(prompt="x", max_tokens=0), "max_tokens"),  # 0: with echo only
    (CompletionRequest(prompt="x", best_of=3), "best_of"),
    (ChatCompletionRequest(messages=CHAT, best_of=2), "best_of"),
    (ChatCompletionRequest(messages=CHAT, n=2, best_of=3), "best_of"),
    (CompletionRequest(prompt=[]), "prompt"),
    (ChatCompletionRequest(messages=CHAT, tools=[{"type": "function"}]), "tools"),
    (ChatCompletionRequest(messages=CHAT, functions=[{"name": "f"}]), "functions"),
    (ChatCompletionRequest(messages=CHAT, tool_choice="auto"), "tool_choice"),
    (ChatCompletionRequest(messages=CHAT, tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (ChatCompletionRequest(messages=CHAT, function_call="auto"), "function_call"),
    (ChatCompletionRequest(messages=CHAT, top_logprobs=3), "top_logprobs"),
])
def test_what_is_not_implemented_is_refused_naming_the_field(body, field):
    with pytest.raises(InvalidArgument) as err:
        chat_request(body, 1024, "r") if isinstance(body, ChatCompletionRequest) else completion_requests(body, "r")
    assert str(err.value).startswith(field)
    assert http_error(err.value).param == field


def test_the_developer_role_is_the_system_role():
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."}, CHAT[1]])
    assert chat_request(body, 1024, "r").chat == (("system", "Be brief."), ("user", "Hi!"))


@pytest.mark.parametrize("message, param", [
    ("top_p must be in (0, 1], got 0", "top_p"),
    ("chat.messages[1].role must be one of system, user, assistant, developer, got 'tool'", "messages.1.role"),
    ("prompt_token_ids entry 70000 is outside the vocabulary [0, 49152)", "prompt_token_ids"),
    ("logit_bias[70000]: token id 70000 is outside the vocabulary [0, 49152)", "logit_bias.70000"),
    ("logit_bias[-1]: token id -1 is outside the vocabulary [0, 49152)", "logit_bias.-1"),
    ("The request holds a value the wire cannot carry: Value out of range", None),
])
def test_an_invalid_argument_names_its_field_as_the_body_spells_it(message, param):
    assert http_error(InvalidArgument(message)).param == param


def test_a_messages_error_says_messages_as_the_body_does():
    error = http_error(InvalidArgument(
        "chat.messages[1].role must be one of system, user, assistant, developer, got 'tool'"))
    assert (error.message, error.param) == (
        "messages[1].role must be one of system, user, assistant, developer, got 'tool'", "messages.1.role")


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://x/y.png"}},
     "messages.0.content: only text parts are supported, got a part of type 'image_url'"),
    ({"type": "text"}, "messages.0.content: a text part needs its text"),
])
def test_a_content_part_meshserve_does_not_serve_is_named(part, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
    error = validation_error(info.value.errors())
    assert (error.status, error.message, error.param) == (400, message, "messages.0.content")


def test_asking_for_no_tool_call_is_what_meshserve_does():
    body = ChatCompletionRequest(messages=CHAT, tool_choice="none", function_call="none", tools=[], functions=[])
    assert chat_request(body, 1024, "r").chat == (("system", "Be brief."), ("user", "Hi!"))


def test_a_null_field_is_its_default_as_openai_and_vllm_read_it():
    nulls = {"n": None, "stream": None, "ignore_eos": None, "logprobs": None, "top_logprobs": None, "stop": None,
             "temperature": None, "max_tokens": None, "return_token_ids": None, "stream_options": None}
    body = ChatCompletionRequest.model_validate({"messages": CHAT, **nulls})
    assert body == ChatCompletionRequest.model_validate({"messages": CHAT})
    r = chat_request(body, 1024, "r")
    assert (r.sampling.n, r.sampling.ignore_eos, r.sampling.logprobs, r.sampling.max_tokens) == (1, False, None, 1024)
    assert CompletionRequest.model_validate({"prompt": "x", "echo": None, "max_tokens": None}).max_tokens == 16
    with pytest.raises(ValueError, match="messages"):  # a required field sent as null is missing
        ChatCompletionRequest.model_validate({"messages": None})


@pytest.mark.parametrize("exc,status,code", [
    (InvalidArgument("top_p must be in (0, 1], got 0"), 400, "invalid_value"),
    (Unauthenticated("unknown API key"), 401, "invalid_api_key"),
    (ModelNotFound("model 'x' is not served here"), 404, "model_not_found"),
    (NotFound("task not found"), 404, "not_found"),
    (AlreadyExists("request_id in use"), 409, "conflict"),
    (ResourceExhausted("queue full", retry_after_s=2.2), 429, "rate_limit_exceeded"),
    (ResourceExhausted("needs 5 KV blocks; quota of 4", retry_after_s=None), 429, "insufficient_quota"),
    (Unavailable("no executor"), 503, "service_unavailable"),
])
def test_domain_errors_map_to_openai_status_and_code(exc, status, code):
    e = http_error(exc)
    assert (e.status, e.code, e.message) == (status, code, str(exc))
    assert e.body() == {"error": {"message": str(exc), "type": e.type, "param": e.param, "code": code}}


def test_a_request_id_conflict_names_request_id_as_its_param():
    e = http_error(AlreadyExists("request_id 'r1' is already in use by an unfinished request"))
    assert (e.status, e.param, e.code) == (409, "request_id", "conflict")


def test_a_field_that_must_be_an_object_says_so_in_json_terms():
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"prompt": "x", "stream_options": 5})
    e = validation_error(err.value.errors())
    assert (e.status, e.param, e.message) == (400, "stream_options", "stream_options: Input should be an object")


def test_retry_after_is_whole_seconds_rounded_up():
    assert http_error(ResourceExhausted("full", retry_after_s=2.2)).response().headers["retry-after"] == "3"
    assert http_error(ResourceExhausted("full", retry_after_s=0.1)).response().headers["retry-after"] == "1"
    final = http_error(ResourceExhausted("never fits", retry_after_s=None)).response().headers
    assert "retry-after" not in final and final["x-should-retry"] == "false"  # OpenAI's clients do not retry it
    assert "x-should-retry" not in http_error(ResourceExhausted("full", retry_after_s=2.2)).response().headers


def test_upstream_codes_without_a_class_keep_their_meaning():
    err = MeshError("executor: deadline")
    err.code = grpc.StatusCode.DEADLINE_EXCEEDED
    assert http_error(err).status == 504
    assert http_error(RuntimeError("bug")).status == 500


def test_body_validation_names_the_field():
    with pytest.raises(Exception) as err:
        ChatCompletionRequest.model_validate({"messages": CHAT, "max_completion_tokens": 0})
    e = validation_error(err.value.errors())
    assert (e.status, e.param) == (400, "max_completion_tokens")


def test_a_delta_with_held_back_text_still_sends_its_token_ids_and_logprobs(tokenizer):
    """A delta whose text is held back (half a UTF-8 character) carries its tokens: with
    ``return_token_ids`` or logprobs its chunk is sent, else it is skipped."""
    from gateway.events import Delta, TokenLogprob
    from gateway.http.formats import ChatFormat, CompletionFormat

    held = Delta(0, "", (1234,), (TokenLogprob(1234, -0.5),))
    assert CompletionFormat("c", "m", 1, tokenizer, False, return_token_ids=True).delta_choice(0, held)["token_ids"] \
        == [1234]
    assert ChatFormat("c", "m", 1, tokenizer, True).delta_choice(0, held)["logprobs"]["content"][0]["logprob"] == -0.5
    assert CompletionFormat("c", "m", 1, tokenizer, False).delta_choice(0, held) is None
