"""Structured outputs over HTTP: a body's OpenAI ``response_format`` and vLLM's
``structured_outputs`` → the request's ``StructuredOutput`` (``meshserve.structured_output``),
on both OpenAI routes (and the task route, which takes their bodies), as vLLM 0.32 reads them:

=========================================  ==========================================
body                                       constraint
=========================================  ==========================================
``response_format: {"type": "text"}``      none (so is an absent or null one)
``response_format: {"type":                ``json_object``
"json_object"}``
``response_format: {"type":                ``json``: the schema (an object), compact
"json_schema", "json_schema": {"name",     (``json_spec``); ``name`` is required (a
"schema", "strict", "description"}}``      string), ``strict`` and ``description``
                                           are taken and change nothing
``structured_outputs: {"json": …}``        ``json``: a schema object or its JSON text
``structured_outputs: {"regex": …}``       ``regex``
``structured_outputs: {"choice": […]}``    ``choice``: the strings, in order
``structured_outputs: {"grammar": …}``     ``grammar``: an EBNF grammar
``structured_outputs: {"json_object":      ``json_object`` (``false`` is refused, as
true}``                                    vLLM refuses it)
=========================================  ==========================================

``structured_outputs`` names exactly one kind (none, or several: 400, vLLM's rule). Its
options ``disable_any_whitespace``, ``disable_additional_properties``,
``whitespace_pattern`` and ``structural_tag`` are served at their defaults only (false,
false, null, null). A ``response_format`` other than text overrides ``structured_outputs``
as vLLM's ``structured_outputs_from_response_format`` does: it replaces its kind's field,
so both naming the same kind is the ``response_format``'s, and two different kinds are
refused (several kinds). ``response_format`` types ``structural_tag`` and unknown ones
are refused.

The constraint is checked here (its limits, and xgrammar parses it), so that every
error is a 400 whose message starts with the field as the body sent it (its ``param``:
``response_format``, ``structured_outputs.json``, ``structured_outputs.choice``…;
``gateway.http.errors``); the core checks it again, as it checks any request's.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.http.schemas import SamplingFields, StructuredOutputsFields
from meshserve import structured_output as structured
from meshserve.errors import InvalidArgument
from meshserve.structured_output import StructuredOutput

# structured_outputs's kinds (vLLM's fields, as the body names them) → the attribute that holds each
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}
_ONE_KIND = "you can only use one kind of structured outputs constraint (json, regex, choice, grammar or json_object)"
# structured_outputs's options served at their defaults only: name → (default, what another value asks for)
_OPTIONS = {
    "disable_any_whitespace": (False, "JSON without whitespace"),
    "disable_additional_properties": (False, "schemas closed to additional properties"),
    "whitespace_pattern": (None, "a whitespace pattern for JSON"),
    "structural_tag": (None, "structural tags"),
}
_RESPONSE_FORMATS = "text, json_object or json_schema"
_SERVED_FORMATS = "only types text, json_object and json_schema are served"


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The body's constraint (None: none), checked.

    Raises:
        InvalidArgument: a ``response_format`` of another type or shape, a
            ``structured_outputs`` with no kind, several kinds or an option other than its
            default, or a constraint the core would refuse (over a limit, or one xgrammar
            cannot parse: a bad schema, regex or grammar); the message starts with the
            field as sent (see the module docstring).
    """
    given = _structured_outputs(body.structured_outputs)
    override = _response_format(body.response_format)
    if override is not None:
        if given is not None and given[0] != override[0]:
            raise InvalidArgument(f"structured_outputs: {_ONE_KIND}; got {given[0]} and {override[0]} "
                                  "(from response_format)")
        given = override
    if given is None:
        return None
    kind, value, name = given
    try:
        constraint = _constraint(kind, value, name)
        structured.validate(constraint)
    except InvalidArgument as exc:
        raise _named(exc, kind, name) from None
    return constraint


def _structured_outputs(fields: StructuredOutputsFields | None) -> tuple[str, Any, str] | None:
    """``structured_outputs`` as (kind, value, the field's name); None when absent.

    Raises:
        InvalidArgument: an option other than its default, no kind or several.
    """
    if fields is None:
        return None
    for option, (default, what) in _OPTIONS.items():
        value = getattr(fields, option)
        if not (value is default if isinstance(default, bool) else value == default):
            raise InvalidArgument(f"structured_outputs.{option} is not supported ({what}); only "
                                  f"structured_outputs.{option}: {json.dumps(default)} is served")
    kinds = [kind for kind, attribute in _KINDS.items() if getattr(fields, attribute) is not None]
    if not kinds:
        raise InvalidArgument("structured_outputs: you must use one kind of structured outputs constraint (json, "
                              "regex, choice, grammar or json_object); got none")
    if len(kinds) > 1:
        raise InvalidArgument(f"structured_outputs: {_ONE_KIND}; got {' and '.join(kinds)}")
    return kinds[0], getattr(fields, _KINDS[kinds[0]]), f"structured_outputs.{kinds[0]}"


def _response_format(response_format: dict[str, Any] | None) -> tuple[str, Any, str] | None:
    """``response_format`` as (kind, value, the field's name); None for text (or none).

    Raises:
        InvalidArgument: a type other than text, json_object or json_schema, or a
            json_schema without its ``json_schema`` object, its ``name`` or its ``schema``
            (each message starts with ``response_format``).
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True, "response_format"
    if kind == "json_schema":
        return "json", _schema_of(response_format.get("json_schema")), "response_format json_schema.schema"
    if kind is None:
        raise InvalidArgument(f"response_format: type is required ({_RESPONSE_FORMATS})")
    if kind == "structural_tag":
        raise InvalidArgument(f"response_format: type structural_tag is not supported (structural tags); "
                              f"{_SERVED_FORMATS}")
    shown = json.dumps(kind, ensure_ascii=False)
    raise InvalidArgument(f"response_format: type must be {_RESPONSE_FORMATS}, got "
                          f"{shown if len(shown) <= 64 else shown[:63] + '…'}")


def _schema_of(json_schema: Any) -> dict[str, Any]:
    """The schema of a ``json_schema`` response format (OpenAI's object: ``name``, ``schema``,
    ``strict``, ``description``).

    Raises:
        InvalidArgument: no object, a ``name`` that is not a string, a ``strict`` that is
            not a boolean, a ``description`` that is not a string, a ``schema`` that is
            missing or not an object.
    """
    if json_schema is None:
        raise InvalidArgument("response_format: type json_schema needs its json_schema object (name and schema)")
    if not isinstance(json_schema, dict):
        raise InvalidArgument("response_format json_schema must be an object (name and schema)")
    if not isinstance(json_schema.get("name"), str):
        raise InvalidArgument("response_format json_schema.name is required: a string")
    for key, kind, check in (("strict", "a boolean", lambda v: isinstance(v, bool)),
                             ("description", "a string", lambda v: isinstance(v, str))):
        if json_schema.get(key) is not None and not check(json_schema[key]):
            raise InvalidArgument(f"response_format json_schema.{key} must be {kind} or null")
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise InvalidArgument(f"response_format json_schema.schema {'is required' if schema is None else 'must be'}"
                              ": a JSON Schema (an object)")
    return schema


def _constraint(kind: str, value: Any, name: str) -> StructuredOutput:
    """The ``StructuredOutput`` of one kind's value (unvalidated).

    Raises:
        InvalidArgument: ``json_object`` false; a ``json`` text that is not JSON, or not an
            object or a boolean (``json_spec``).
    """
    if kind == "json":
        return StructuredOutput("json", structured.json_spec(value))
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(f"{name} must be true if set; omit structured_outputs to disable structured "
                                  "outputs")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(value))
    return StructuredOutput(kind, value)


def _named(error: InvalidArgument, kind: str, name: str) -> InvalidArgument:
    """``error`` with the field as sent in place of ``structured output <kind>``, where
    ``meshserve.structured_output``'s messages name it (``structured output regex: …`` →
    ``structured_outputs.regex: …``); otherwise prefixed with it."""
    message, prefix = str(error), f"structured output {kind}"
    if message.startswith(name):
        return error
    return InvalidArgument(name + message[len(prefix):] if message.startswith(prefix) else f"{name}: {message}")
