"""Structured outputs over HTTP against the real engine, through the ``openai`` client:
a ``choice`` answer is one of the choices and equals the gRPC path's (streamed too), a
``json_schema`` answer parses and fits its schema, ``max_tokens`` can cut an answer
before it is complete (``length``), and a bad spec is a 400 naming the field as sent."""

import json

import openai
import pytest

from meshserve.client import build_request, generate
from meshserve.structured_output import StructuredOutput
from tests.support.http_mesh import KEY_A, SERVED

pytestmark = pytest.mark.model
GRPC_KEY = (("x-api-key", KEY_A),)
QUESTION = "Is the sky blue? Answer yes or no."
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture
def aclient(http_mesh):
    return openai.AsyncOpenAI(base_url=f"{http_mesh.http_url}/v1", api_key=KEY_A, max_retries=0)


async def test_a_choice_answer_is_one_of_the_choices_and_equals_the_grpc_path(http_mesh, aclient):
    constraint = StructuredOutput("choice", choices=tuple(CHOICES))
    chat_ref = await generate(http_mesh.stub, build_request(chat=[("user", QUESTION)], max_tokens=8, temperature=0,
                                                            structured_output=constraint), GRPC_KEY)
    text_ref = await generate(http_mesh.stub, build_request(QUESTION, max_tokens=8, temperature=0,
                                                            structured_output=constraint), GRPC_KEY)
    assert chat_ref.text in CHOICES and text_ref.text in CHOICES
    assert (chat_ref.finish_reason, text_ref.finish_reason) == ("stop", "stop")
    body = {"structured_outputs": {"choice": CHOICES}}
    chat = await aclient.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=8, temperature=0, extra_body=body)
    completion = await aclient.completions.create(model=SERVED, prompt=QUESTION, max_tokens=8, temperature=0,
                                                  extra_body=body)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (chat_ref.text, "stop")
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (text_ref.text, "stop")
    stream = await aclient.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": QUESTION}],
                                                   max_tokens=8, temperature=0, extra_body=body, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_json_schema_answer_parses_and_fits_its_schema(aclient):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "population", "is_capital"]}
    out = await aclient.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=96,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    [choice] = out.choices
    assert choice.finish_reason == "stop", choice.message.content
    answer = json.loads(choice.message.content)
    assert list(answer) == ["city", "population", "is_capital"]  # every required key, in the schema's order
    assert isinstance(answer["city"], str) and isinstance(answer["is_capital"], bool)
    assert isinstance(answer["population"], int) and not isinstance(answer["population"], bool)


async def test_max_tokens_can_cut_the_answer_before_it_is_complete(aclient):
    out = await aclient.completions.create(model=SERVED, prompt="Paris as JSON:", max_tokens=3, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}})
    [choice] = out.choices
    assert (choice.finish_reason, out.usage.completion_tokens) == ("length", 3)
    with pytest.raises(json.JSONDecodeError):  # a prefix of a JSON value only
        json.loads(choice.text)


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", 'response_format json_schema.schema: Unsupported type "objec"'),
    ({"extra_body": {"structured_outputs": {"json": {"type": "objec"}}}},
     "structured_outputs.json", 'structured_outputs.json: Unsupported type "objec"'),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}},
     "structured_outputs.regex", "structured_outputs.regex: Regex parsing error at position 4: Unclosed '['"),
])
async def test_a_bad_spec_is_a_400_naming_the_field(http_mesh, aclient, fields, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, **fields)
    assert (err.value.status_code, err.value.body["param"], err.value.body["message"]) == (400, param, message)
    await http_mesh.wait_released()


async def test_a_request_whose_grammar_is_too_slow_ends_abort_over_http_and_grpc(http_mesh, aclient, monkeypatch):
    """A mask fill over the engine's limit (set below any fill here) ends the request
    "abort" after one token, on both faces; the mesh then holds no block or lease."""
    from executor.engine import structured_output

    monkeypatch.setattr(structured_output, "MAX_MASK_FILL_S", -1.0)
    constraint = StructuredOutput("json_object")
    over_grpc = await generate(http_mesh.stub, build_request("Paris as JSON:", max_tokens=8, temperature=0,
                                                             structured_output=constraint), GRPC_KEY)
    out = await aclient.completions.create(model=SERVED, prompt="Paris as JSON:", max_tokens=8, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert (over_grpc.finish_reason, len(over_grpc.token_ids)) == ("abort", 1)
    assert (out.choices[0].finish_reason, out.choices[0].text, out.usage.completion_tokens) == (
        "abort", over_grpc.text, 1)
    await http_mesh.wait_released()
