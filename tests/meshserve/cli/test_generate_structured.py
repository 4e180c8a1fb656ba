"""Structured outputs from the client: ``build_request(structured_output=…)`` writes each
kind into the request's sampling (read back as the same constraint), and ``meshserve
generate``'s ``--json-schema FILE``, ``--json-object``, ``--regex RE``, ``--choice TEXT``
(repeatable) and ``--grammar FILE`` reach the request; two kinds, or a file that cannot
be read or is not a JSON Schema, are usage errors (exit 2, nothing sent). The gateway
calls are faked (``generate_choices``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.client import build_request
from meshserve.sampling import params_from_proto
from meshserve.structured_output import StructuredOutput
from tests.support.generate_requests import recording_requests

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("constraint", [
    StructuredOutput("json", '{"type":"string"}'), StructuredOutput("json_object"),
    StructuredOutput("regex", "[a-z]+"), StructuredOutput("choice", choices=("yes", "no")),
    StructuredOutput("grammar", 'root ::= "a"'), None,
])
def test_build_request_carries_each_kind(constraint):
    request = build_request("Hi", structured_output=constraint)
    assert request.sampling.HasField("structured_output") == (constraint is not None)
    assert params_from_proto(request.sampling).structured_output == constraint


@pytest.fixture
def generate(monkeypatch):
    """Runs ``meshserve generate --prompt sky`` with the given options; returns (result, requests sent)."""
    sent = recording_requests(monkeypatch)

    def run(*options: str):
        sent.clear()
        result = CliRunner().invoke(app, ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", "--prompt",
                                          "sky", *options], env={"COLUMNS": "300"})
        return result, [params_from_proto(r.sampling).structured_output for r in sent]

    return run


def test_each_option_reaches_the_request(generate, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA, indent=2))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    for options, expected in [
        (["--json-schema", str(schema)],
         StructuredOutput("json", '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}')),
        (["--json-object"], StructuredOutput("json_object")),
        (["--regex", "[0-9]+"], StructuredOutput("regex", "[0-9]+")),
        (["--choice", "yes", "--choice", "no"], StructuredOutput("choice", choices=("yes", "no"))),
        (["--grammar", str(grammar)], StructuredOutput("grammar", 'root ::= "yes" | "no"\n')),
        ([], None),
    ]:
        result, sent = generate(*options)
        assert result.exit_code == 0, result.output
        assert sent == [expected]


def test_two_kinds_or_a_bad_file_are_usage_errors_and_nothing_is_sent(generate, tmp_path):
    not_json = tmp_path / "bad.json"
    not_json.write_text("{type: object}")
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    for options, message in [
        (["--regex", "a", "--choice", "a"], "one structured output at a time: --regex and --choice were given"),
        (["--json-object", "--grammar", "g"],
         "one structured output at a time: --json-object and --grammar were given"),
        (["--json-schema", str(tmp_path / "none.json")], f"cannot read {tmp_path / 'none.json'}: No such file"),
        (["--grammar", str(tmp_path)], f"cannot read {tmp_path}: Is a directory"),
        (["--json-schema", str(not_json)], (f"{not_json}: the schema is not valid JSON (Expecting property name "
                                           "enclosed in double quotes: line 1 column 2 (char 1))")),
        (["--json-schema", str(a_list)], f"{a_list}: a JSON Schema is an object or a boolean, got list"),
    ]:
        result, sent = generate(*options)
        assert result.exit_code == 2 and message in result.output, result.output
        assert sent == []


def test_json_output_writes_a_forbidden_tokens_minus_infinity_as_the_http_api_does():
    """A structured output gives -inf to forbidden tokens; ``--json`` prints strict JSON
    (-9999.0, the HTTP API's and vLLM's value), never ``-Infinity``."""
    from meshserve.client import Logprob
    from meshserve.sampling import LOGPROB_FLOOR

    entry = Logprob(49, -0.0095, ((49, -0.0095), (50, -4.5), (1, float("-inf"))), 1)
    text = json.dumps(entry.as_json(), allow_nan=False)
    assert json.loads(text) == {"token_id": 49, "logprob": -0.0095, "rank": 1,
                                "top": [[49, -0.0095], [50, -4.5], [1, LOGPROB_FLOOR]]}
    assert Logprob(2, float("-inf")).as_json()["logprob"] == -9999.0
