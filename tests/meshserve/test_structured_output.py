"""The shared structured-output spec: JSON Schemas keep their key order, choices become
vLLM's escaped EBNF, every limit and parse error is INVALID_ARGUMENT naming the kind,
and the proto carries each kind unchanged."""

from __future__ import annotations

import pytest

from meshserve import structured_output as so
from meshserve.errors import InvalidArgument
from meshserve.sampling import SamplingParams, params_from_proto, to_proto, validate
from meshserve.structured_output import StructuredOutput
from meshserve.v1 import common_pb2


def test_a_schema_keeps_its_key_order_which_is_the_order_properties_are_generated():
    assert so.json_spec({"name": {}, "age": {}}) == '{"name":{},"age":{}}'
    assert so.json_spec('{"b": 1, "a": [1, 2]}') == '{"b":1,"a":[1,2]}'
    assert so.json_spec({"é": "ü"}) == '{"é":"ü"}'
    assert so.json_spec(True) == "true"


@pytest.mark.parametrize("schema, message", [
    ("{not json", "structured output json: the schema is not valid JSON"),
    ([1, 2], "structured output json: a JSON Schema is an object or a boolean, got list"),
    ('"text"', "structured output json: a JSON Schema is an object or a boolean, got str"),
])
def test_a_schema_that_is_not_one_is_refused(schema, message):
    with pytest.raises(InvalidArgument) as raised:
        so.json_spec(schema)
    assert str(raised.value).startswith(message)


def test_choices_become_vllms_escaped_grammar():
    """vLLM's ``choice_as_grammar``: backslash, quote, LF, CR, tab escaped; other C0
    controls and DEL as \\uXXXX; everything else as it is."""
    assert so.choice_grammar(["yes", "no"]) == 'root ::= "yes" | "no"'
    assert so.choice_grammar(['a "b"\\c', "x\ny\r\tz", "\x01\x7f", "café ☕"]) == (
        'root ::= "a \\"b\\"\\\\c" | "x\\ny\\r\\tz" | "\\u0001\\u007f" | "café ☕"')


def test_an_escaped_choice_parses_and_matches_only_itself():
    import xgrammar

    choices = ('say "hi"\\', "line\nbreak", "tab\there")
    grammar = so.grammar(StructuredOutput("choice", choices=choices))
    assert "root ::=" in str(grammar)
    matcher = xgrammar.testing._is_grammar_accept_string  # xgrammar's own string check
    for choice in choices:
        assert matcher(grammar, choice)
    assert not matcher(grammar, 'say "hi"')


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("xml"), "structured output kind must be one of json, json_object, regex, choice, grammar, "
                              "got 'xml'"),
    (StructuredOutput("json"), "structured output json must not be empty"),
    (StructuredOutput("json", "x" * 65_537), "structured output json takes at most 65536 characters, got 65537"),
    (StructuredOutput("regex", "[a-"), "structured output regex: Regex parsing error at position 4: Unclosed '['"),
    (StructuredOutput("grammar", "root ::= "), "structured output grammar: EBNF parser error at line 1"),
    (StructuredOutput("json", '{"type": "foo"}'), 'structured output json: Unsupported type "foo"'),
    (StructuredOutput("json_object", "{}"), "structured output json_object takes no spec"),
    (StructuredOutput("regex", "a", ("a",)), "structured output regex takes no choices"),
    (StructuredOutput("choice"), "structured output choice takes 1 to 1024 strings, got 0"),
    (StructuredOutput("choice", choices=("a",) * 1025), "structured output choice takes 1 to 1024 strings, got 1025"),
    (StructuredOutput("choice", choices=("a", "")), "structured output choice strings must not be empty"),
    (StructuredOutput("choice", choices=("x" * 40_000, "y" * 30_000)),
     "structured output choice strings take at most 65536 characters together"),
])
def test_every_bad_spec_is_invalid_argument_naming_its_kind(spec, message):
    with pytest.raises(InvalidArgument) as raised:
        validate(SamplingParams(structured_output=spec), max_model_len=64, vocab_size=100)
    assert str(raised.value).startswith(message)
    assert "/project/" not in str(raised.value) and ".cc:" not in str(raised.value)  # no C++ source location


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 10**30}, "structured output json: Integer exceeds maximum limit"),
    ({"enum": [10**400]}, "structured output json: xgrammar cannot convert it (it gave no reason)"),
])
def test_xgrammars_failed_checks_and_silent_refusals_read_as_reasons(schema, message):
    """xgrammar's ``Check failed: (cond) is false:`` prefix is not the user's reason, and
    an error with no message still says why (it ended in "json: ")."""
    with pytest.raises(InvalidArgument) as raised:
        so.validate(StructuredOutput("json", so.json_spec(schema)))
    assert str(raised.value) == message


@pytest.mark.parametrize("spec", [
    StructuredOutput("json", so.json_spec({"type": "object"})),
    StructuredOutput("json_object"),
    StructuredOutput("regex", "[a-z]+"),
    StructuredOutput("choice", choices=("b", "a", 'q"\n')),
    StructuredOutput("grammar", 'root ::= "x" | "y"'),
])
def test_each_kind_crosses_the_wire_unchanged(spec):
    params = validate(SamplingParams(temperature=0.0, structured_output=spec), max_model_len=64, vocab_size=100)
    msg = common_pb2.SamplingParams()
    to_proto(params, msg)
    assert params_from_proto(common_pb2.SamplingParams.FromString(msg.SerializeToString())) == params


def test_no_constraint_is_none_on_the_wire():
    msg = common_pb2.SamplingParams()
    to_proto(SamplingParams(), msg)
    assert not msg.HasField("structured_output")
    assert params_from_proto(msg).structured_output is None


def test_a_valid_spec_is_parsed_once_and_a_bad_one_each_time(monkeypatch):
    """A gateway validates each request's constraint twice (HTTP conversion, then the core):
    xgrammar's parse runs once for a spec that passes."""
    calls = []
    real = so.grammar
    monkeypatch.setattr(so, "grammar", lambda spec: calls.append(spec) or real(spec))
    so._parses.cache_clear()
    good, bad = StructuredOutput("regex", "[0-9]{2}-only-once"), StructuredOutput("regex", "[0-9")
    for _ in range(3):
        validate(SamplingParams(structured_output=good), max_model_len=64, vocab_size=100)
        with pytest.raises(InvalidArgument):
            validate(SamplingParams(structured_output=bad), max_model_len=64, vocab_size=100)
    assert calls == [good, bad, bad, bad]
