"""Structured outputs over HTTP (``gateway.http.structured``): OpenAI's ``response_format``
and vLLM's ``structured_outputs`` on both routes become the request's exact
``StructuredOutput``; every refusal is a 400 whose ``param`` names the field as sent; the
constraint reaches the executor from the OpenAI routes and from a task."""

from __future__ import annotations

import json

import pytest

from gateway.http.convert import chat_request, completion_requests
from gateway.http.errors import http_error
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from meshserve.errors import InvalidArgument
from meshserve.structured_output import StructuredOutput
from tests.support.inprocess_app import ScriptedMesh, app_client, finished_task

CHAT = [{"role": "user", "content": "Hi"}]
ROUTES = ["chat", "completions"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SCHEMA_SPEC = ('{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
               '"required":["name","age"]}')  # json_spec's text: compact, its keys in the order sent
ONE_KIND = "you can only use one kind of structured outputs constraint (json, regex, choice, grammar or json_object)"


def constraint(route: str, **fields) -> StructuredOutput | None:
    """The constraint the route's body with ``fields`` asks for, converted as the route converts it."""
    if route == "chat":
        return chat_request(ChatCompletionRequest.model_validate({"messages": CHAT, **fields}), 1024,
                            "r").sampling.structured_output
    [request] = completion_requests(CompletionRequest.model_validate({"prompt": "Hi", **fields}), "r")
    return request.sampling.structured_output


def json_schema_format(schema, **more) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **more}}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": None, "structured_outputs": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": json_schema_format(SCHEMA)}, StructuredOutput("json", SCHEMA_SPEC)),
    ({"response_format": json_schema_format(SCHEMA, strict=True, description="a person")},
     StructuredOutput("json", SCHEMA_SPEC)),
    ({"response_format": json_schema_format(SCHEMA, strict=None, description=None)},
     StructuredOutput("json", SCHEMA_SPEC)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", SCHEMA_SPEC)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutput("json", SCHEMA_SPEC)),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]+"}}, StructuredOutput("regex", "[0-9]{3}-[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe \"so\""]}},
     StructuredOutput("choice", choices=("yes", "no", 'maybe "so"'))),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    # null fields are their defaults; the options at their defaults pass; unknown keys are ignored (vLLM's)
    ({"structured_outputs": {"regex": "a+", "choice": None, "json": None, "grammar": None, "json_object": None,
                             "disable_any_whitespace": False, "disable_additional_properties": False,
                             "whitespace_pattern": None, "structural_tag": None, "backend": "xgrammar"}},
     StructuredOutput("regex", "a+")),
    # a response_format other than text replaces its kind's field of structured_outputs (vLLM's)
    ({"structured_outputs": {"json": {"type": "string"}}, "response_format": json_schema_format(SCHEMA)},
     StructuredOutput("json", SCHEMA_SPEC)),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     StructuredOutput("json_object")),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
     StructuredOutput("choice", choices=("a",))),
])
def test_each_form_becomes_its_exact_constraint(route, fields, expected):
    assert constraint(route, **fields) == expected


def test_every_prompt_of_a_completions_body_carries_the_constraint():
    body = CompletionRequest.model_validate({"prompt": ["a", "b"], "structured_outputs": {"choice": ["x", "y"]}})
    assert [r.sampling.structured_output for r in completion_requests(body, "r")] == [
        StructuredOutput("choice", choices=("x", "y"))] * 2


REFUSED = [
    # response_format: every error names it
    ({"response_format": {"type": "json_schema"}},
     "response_format: type json_schema needs its json_schema object (name and schema)", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person"}}},
     "response_format json_schema.schema is required: a JSON Schema (an object)", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}},
     "response_format json_schema.schema must be: a JSON Schema (an object)", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format json_schema.name is required: a string", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": ["person"]}},
     "response_format json_schema must be an object (name and schema)", "response_format"),
    ({"response_format": json_schema_format(SCHEMA, strict="yes")},
     "response_format json_schema.strict must be a boolean or null", "response_format"),
    ({"response_format": json_schema_format({"type": "objec"})},
     'response_format json_schema.schema: Unsupported type "objec"', "response_format"),
    ({"response_format": json_schema_format({"properties": {"a": {"$ref": "#/nope"}}})},
     "response_format json_schema.schema: Cannot find field nope in #/nope", "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {}}},
     ("response_format: type structural_tag is not supported (structural tags); only types text, json_object and "
     "json_schema are served"), "response_format"),
    ({"response_format": {"type": "xml"}},
     'response_format: type must be text, json_object or json_schema, got "xml"', "response_format"),
    ({"response_format": {}}, "response_format: type is required (text, json_object or json_schema)",
     "response_format"),
    # structured_outputs: the kind's field, or the object itself when the kinds are wrong
    ({"structured_outputs": {"json": '{"type": '}},
     "structured_outputs.json: the schema is not valid JSON (Expecting value: line 1 column 10 (char 9))",
     "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1]"}},
     "structured_outputs.json: a JSON Schema is an object or a boolean, got list", "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "objec"}}},
     'structured_outputs.json: Unsupported type "objec"', "structured_outputs.json"),
    ({"structured_outputs": {"json": '{"items":' * 64 + "{}" + "}" * 64}},
     "structured_outputs.json: the schema is nested too deeply: objects and arrays may nest at most 64 levels",
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex: Regex parsing error at position 4: Unclosed '['", "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex must not be empty", "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= value"}},
     'structured_outputs.grammar: EBNF parser error at line 1, column 10: Rule "value" is not defined',
     "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}},
     ('structured_outputs.grammar: EBNF parser error at line 1, column 1: The root rule with name "root" is not '
     'found'), "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice takes 1 to 1024 strings, got 0",
     "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice strings must not be empty",
     "structured_outputs.choice"),
    ({"structured_outputs": {"choice": [str(i) for i in range(1025)]}},
     "structured_outputs.choice takes 1 to 1024 strings, got 1025", "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a" * 65_537}},
     "structured_outputs.regex takes at most 65536 characters, got 65537", "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": False}},
     "structured_outputs.json_object must be true if set; omit structured_outputs to disable structured outputs",
     "structured_outputs.json_object"),
    ({"structured_outputs": {}}, ("structured_outputs: you must use one kind of structured outputs constraint (json, "
     "regex, choice, grammar or json_object); got none"), "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"], "grammar": 'root ::= "a"'}},
     f"structured_outputs: {ONE_KIND}; got regex and choice and grammar", "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     f"structured_outputs: {ONE_KIND}; got regex and json_object (from response_format)", "structured_outputs"),
    ({"structured_outputs": {"json_object": True}, "response_format": json_schema_format(SCHEMA)},
     f"structured_outputs: {ONE_KIND}; got json_object and json (from response_format)", "structured_outputs"),
    # its options are served at their defaults only
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     ("structured_outputs.disable_any_whitespace is not supported (JSON without whitespace); only "
     "structured_outputs.disable_any_whitespace: false is served"), "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     ("structured_outputs.disable_additional_properties is not supported (schemas closed to additional properties); "
     "only structured_outputs.disable_additional_properties: false is served"),
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     ("structured_outputs.whitespace_pattern is not supported (a whitespace pattern for JSON); only "
     "structured_outputs.whitespace_pattern: null is served"), "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
     ("structured_outputs.structural_tag is not supported (structural tags); only structured_outputs.structural_tag: "
     "null is served"), "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": 0}},  # a boolean only as itself
     ("structured_outputs.disable_any_whitespace is not supported (JSON without whitespace); only "
     "structured_outputs.disable_any_whitespace: false is served"), "structured_outputs.disable_any_whitespace"),
    # vLLM 0.32 no longer takes the older fields
    ({"guided_choice": ["a", "b"]}, ("guided_choice is not supported (vLLM's older guided decoding; use "
     "structured_outputs or response_format)"), "guided_choice"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields, message, param", REFUSED, ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)])
def test_each_refusal_names_the_field_as_sent(route, fields, message, param):
    with pytest.raises(InvalidArgument) as err:
        constraint(route, **fields)
    assert (str(err.value), http_error(err.value).param) == (message, param)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/tasks", {"prompt": "Hi"}),
])
@pytest.mark.parametrize("fields, message, param", [
    ({"response_format": json_schema_format({"type": "objec"})},
     'response_format json_schema.schema: Unsupported type "objec"', "response_format"),
    ({"structured_outputs": {"regex": "(a"}},
     "structured_outputs.regex: Regex parsing error at position 3: The parenthesis is not closed.",
     "structured_outputs.regex"),
    # the body's types, refused before conversion (pydantic), name the field too
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice: Input should be a valid list",
     "structured_outputs.choice"),
    ({"structured_outputs": {"json": 5}},
     "structured_outputs.json: Input should be a JSON Schema (an object) or its JSON text (a string)",
     "structured_outputs.json"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object: Input should be a valid boolean",
     "structured_outputs.json_object"),
    ({"structured_outputs": "json"}, "structured_outputs: Input should be an object", "structured_outputs"),
    ({"response_format": "json_object"}, "response_format: Input should be an object", "response_format"),
])
async def test_the_routes_answer_a_bad_constraint_with_a_400_naming_it(tokenizer, path, body, fields, message,
                                                                       param):
    mesh = ScriptedMesh(tokenizer.encode("Hi", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(path, json={**body, **fields})
    assert (r.status_code, r.json()) == (400, {"error": {"message": message, "type": "invalid_request_error",
                                                         "param": param, "code": "invalid_value"}})
    assert mesh.params == []  # refused before anything ran


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    ("/v1/completions", {"prompt": ["Hi", "Yo"]}),
])
async def test_the_constraint_reaches_the_executor(tokenizer, path, body):
    mesh = ScriptedMesh(tokenizer.encode('{"a"', add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(path, json={**body, "max_tokens": 4, "response_format": json_schema_format(SCHEMA)})
    assert r.status_code == 200, r.text
    assert [p.structured_output for p in mesh.params] == [StructuredOutput("json", SCHEMA_SPEC)] * (
        2 if path == "/v1/completions" else 1)


@pytest.mark.parametrize("body", [{"prompt": "Hi"}, {"messages": CHAT}])
async def test_a_task_carries_the_constraint_to_the_executor(tokenizer, body):
    mesh = ScriptedMesh(tokenizer.encode("yes", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        status = await finished_task(http, {**body, "max_tokens": 2,
                                            "structured_outputs": {"choice": ["yes", "no"]}})
    assert status["state"] == "TASK_STATE_SUCCEEDED", status
    assert [p.structured_output for p in mesh.params] == [StructuredOutput("choice", choices=("yes", "no"))]
