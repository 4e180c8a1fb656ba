"""A JSON Schema's objects and arrays nest at most ``MAX_JSON_NESTING`` levels (vLLM's
limit), checked before xgrammar converts it: its conversion time grows steeply with the
depth (a 62 KB schema 2,500 arrays deep ran past a minute), and a schema object nested
past Python's recursion limit made ``json_spec`` raise RecursionError (a 500 over HTTP)."""

from __future__ import annotations

import time

import pytest

from meshserve.errors import InvalidArgument
from meshserve.structured_output import MAX_JSON_NESTING, StructuredOutput, json_spec, validate

TOO_DEEP = (f"structured output json: the schema is nested too deeply: objects and arrays may nest at most "
            f"{MAX_JSON_NESTING} levels")


def arrays(depth: int) -> dict:
    """A schema of ``depth`` nested arrays of strings: ``depth`` levels below its root."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_the_deepest_schema_allowed_parses_and_one_level_more_is_refused():
    deepest = json_spec(arrays(MAX_JSON_NESTING - 1))
    validate(StructuredOutput("json", deepest))
    with pytest.raises(InvalidArgument) as err:
        json_spec(arrays(MAX_JSON_NESTING))
    assert str(err.value) == TOO_DEEP
    with pytest.raises(InvalidArgument) as err:  # a spec built elsewhere (a gRPC caller's) is checked too
        validate(StructuredOutput("json", '{"items":' * MAX_JSON_NESTING + "{}" + "}" * MAX_JSON_NESTING))
    assert str(err.value) == TOO_DEEP


@pytest.mark.parametrize("text", [
    '{"items":' * 2_500 + '{"type":"string"}' + "}" * 2_500,  # 62 KB: within the size limit
    "[" * 100_000 + "]" * 100_000,  # deeper than Python's parser goes (RecursionError inside)
])
def test_a_very_deep_schema_is_refused_at_once(text):
    started = time.monotonic()
    for check in (lambda: json_spec(text), lambda: validate(StructuredOutput("json", text[:65_536]))):
        with pytest.raises(InvalidArgument) as err:
            check()
        assert str(err.value) == TOO_DEEP
    assert time.monotonic() - started < 5
