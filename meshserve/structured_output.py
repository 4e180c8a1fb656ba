"""Structured outputs: a request's constraint on the text it may generate (pure data).

A ``StructuredOutput`` names one formal language, and generation samples only tokens
that keep the output a prefix of a sentence of it (vLLM's structured outputs, OpenAI's
``response_format``). Five kinds, vLLM's ``StructuredOutputsParams`` fields:

* ``json``: a JSON Schema (its JSON text): the output is a JSON value it accepts;
* ``json_object``: a JSON object (``response_format: {"type": "json_object"}``; the
  schema ``{"type": "object"}``, as vLLM's xgrammar backend compiles it);
* ``regex``: a regular expression the whole output matches;
* ``choice``: exactly one of the given strings;
* ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF's: ``root ::= ...``).

The grammar engine is xgrammar (Dong et al., 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"; vLLM's default backend).
This module only parses a spec into xgrammar's tokenizer-free ``Grammar`` (cheap, a
few milliseconds): the gateway does it to refuse a bad spec before admission, the
executor to compile it against its tokenizer (``executor.engine.structured_output``).
A choice list becomes the grammar ``root ::= "a" | "b"`` with vLLM's escaping
(``vllm/v1/structured_output/utils.py``, ``choice_as_grammar``).

Limits (a spec is compiled against the whole vocabulary, so its size is bounded):
a spec of at most ``MAX_SPEC_CHARS`` characters; at most ``MAX_CHOICES`` choices, each
non-empty, together at most ``MAX_SPEC_CHARS`` characters; a JSON Schema's objects and
arrays nested at most ``MAX_JSON_NESTING`` levels below its root (vLLM's limit: xgrammar's
conversion time grows steeply with depth, 3 s at 400 levels, over a minute at 1,200,
all of it inside one call that cannot be interrupted).

xgrammar's import takes ~2 s (it imports torch), so a service that parses specs calls
``preload`` at start: the import then runs in a background thread, not on the event
loop of the first constrained request.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import threading
from dataclasses import dataclass, field

from meshserve.errors import InvalidArgument

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1_024
MAX_JSON_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object's grammar (vLLM's xgrammar backend)


@dataclass(frozen=True)
class StructuredOutput:
    """One request's structured-output constraint.

    Attributes:
        kind: one of ``KINDS``.
        spec: the JSON Schema's JSON text (``json``), the regex (``regex``), the EBNF
            grammar (``grammar``); "" for ``json_object`` and ``choice``.
        choices: the strings of ``choice`` (in order); () for the other kinds.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ebnf(self) -> str | None:
        """The EBNF grammar of ``grammar`` and ``choice``; None for the other kinds."""
        if self.kind == "choice":
            return choice_grammar(self.choices)
        return self.spec if self.kind == "grammar" else None

    def key(self) -> dict:
        """A JSON-ready form that names the constraint exactly (the result cache's key)."""
        return {"kind": self.kind, "spec": self.spec, "choices": list(self.choices)}


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """The EBNF grammar accepting exactly one of ``choices`` (vLLM's ``choice_as_grammar``:
    backslash, quote, LF, CR and tab escaped, other C0 controls and DEL as ``\\uXXXX``)."""
    return "root ::= " + " | ".join(f'"{_escape_ebnf(c)}"' for c in choices)


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_ebnf(text: str) -> str:
    return "".join(_EBNF_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                   for ch in text)


def json_spec(schema) -> str:
    """A JSON Schema given as a dict (or a JSON text) as the compact JSON text ``spec``
    holds (no spaces). Key order is kept: it is the order in which the output's object
    properties are generated (xgrammar's, as vLLM's), so two orders are two constraints.

    Raises:
        InvalidArgument: a text that is not JSON, a schema that is not an object or a
            boolean, or one nested deeper than ``MAX_JSON_NESTING``.
    """
    if isinstance(schema, str):
        schema = _parsed(schema)
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"structured output json: a JSON Schema is an object or a boolean, "
                              f"got {type(schema).__name__}")
    _check_nesting(schema)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _parsed(text: str):
    """A JSON text's value.

    Raises:
        InvalidArgument: not JSON, or nested too deeply for Python's parser (deeper than
            ``MAX_JSON_NESTING`` anyway).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as error:
        raise InvalidArgument(f"structured output json: the schema is not valid JSON ({error})") from None


def _too_deep() -> InvalidArgument:
    return InvalidArgument(f"structured output json: the schema is nested too deeply: objects and arrays may nest "
                           f"at most {MAX_JSON_NESTING} levels")


def _check_nesting(value) -> None:
    """Refuses a JSON value whose objects and arrays nest more than ``MAX_JSON_NESTING``
    levels below the root (level by level, without recursion: vLLM's ``check_json_nesting``).

    Raises:
        InvalidArgument: nested too deeply.
    """
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(MAX_JSON_NESTING):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise _too_deep()


def validate(structured: StructuredOutput) -> None:
    """Checks the kind, the limits (a JSON Schema's nesting too), and that xgrammar
    parses the spec.

    Raises:
        InvalidArgument: the message names the kind and the reason (xgrammar's, when it
            refuses the spec).
    """
    if structured.kind not in KINDS:
        raise InvalidArgument(f"structured output kind must be one of {', '.join(KINDS)}, got {structured.kind!r}")
    if structured.kind == "choice":
        if not 1 <= len(structured.choices) <= MAX_CHOICES:
            raise InvalidArgument(f"structured output choice takes 1 to {MAX_CHOICES} strings, "
                                  f"got {len(structured.choices)}")
        if not all(structured.choices):
            raise InvalidArgument("structured output choice strings must not be empty")
        if sum(map(len, structured.choices)) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"structured output choice strings take at most {MAX_SPEC_CHARS} characters "
                                  "together")
    elif structured.choices:
        raise InvalidArgument(f"structured output {structured.kind} takes no choices")
    if structured.kind in ("json", "regex", "grammar"):
        if not structured.spec:
            raise InvalidArgument(f"structured output {structured.kind} must not be empty")
        if len(structured.spec) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"structured output {structured.kind} takes at most {MAX_SPEC_CHARS} characters, "
                                  f"got {len(structured.spec)}")
    elif structured.spec:
        raise InvalidArgument(f"structured output {structured.kind} takes no spec")
    _parses(structured)


@functools.lru_cache(maxsize=256)
def _parses(structured: StructuredOutput) -> None:
    """The nesting check and xgrammar's parse of a spec within the limits, remembered for
    the specs that pass: a gateway checks a request's twice (HTTP's conversion names the
    field, the core checks every request), and a 64 KB schema takes up to ~0.4 s to parse
    on one core, on the event loop. A spec that fails is parsed again each time."""
    if structured.kind == "json":  # before xgrammar: its time grows steeply with the depth
        _check_nesting(_parsed(structured.spec))
    grammar(structured)


def grammar(structured: StructuredOutput):
    """xgrammar's tokenizer-free ``Grammar`` of the constraint (imports xgrammar).

    Raises:
        InvalidArgument: xgrammar cannot parse the spec; its reason, without its
            source location, is in the message.
    """
    import xgrammar  # heavy (seconds, with torch): only when a request has a constraint

    try:
        if structured.kind == "json":
            return xgrammar.Grammar.from_json_schema(structured.spec)
        if structured.kind == "json_object":
            return xgrammar.Grammar.from_json_schema(JSON_OBJECT_SCHEMA)
        if structured.kind == "regex":
            return xgrammar.Grammar.from_regex(structured.spec)
        return xgrammar.Grammar.from_ebnf(structured.ebnf)
    except (RuntimeError, ValueError) as error:
        raise InvalidArgument(f"structured output {structured.kind}: {reason(error)}") from None


_preloading: list[threading.Thread] = []
_preload_lock = threading.Lock()


def preload() -> threading.Thread:
    """Imports xgrammar in a daemon thread, once per process; returns that thread."""
    with _preload_lock:
        if not _preloading:
            thread = threading.Thread(target=importlib.import_module, args=("xgrammar",), name="xgrammar-import",
                                      daemon=True)
            thread.start()
            _preloading.append(thread)
        return _preloading[0]


_SOURCE_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_FAILED_CHECK = re.compile(r"^Check failed: \(.*?\) is false: ")


def reason(error: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, its ``Check failed:
    (cond) is false:`` one and trailing space; a message it left empty (a schema with an
    integer of hundreds of digits) says so."""
    text = _FAILED_CHECK.sub("", _SOURCE_LOCATION.sub("", str(error)).strip())
    return text or "xgrammar cannot convert it (it gave no reason)"


def to_proto(structured: StructuredOutput, msg) -> None:
    """Writes ``structured`` into an empty ``meshserve.v1.StructuredOutput`` message."""
    if structured.kind == "json":
        msg.json_schema = structured.spec
    elif structured.kind == "json_object":
        msg.json_object = True
    elif structured.kind == "regex":
        msg.regex = structured.spec
    elif structured.kind == "choice":
        msg.choice.values.extend(structured.choices)
    else:
        msg.grammar = structured.spec


def from_proto(msg) -> StructuredOutput | None:
    """The constraint a ``meshserve.v1.StructuredOutput`` names; None when no kind is set
    (not yet validated: ``validate``)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutput("json", msg.json_schema)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.values))
    return StructuredOutput(kind, getattr(msg, kind))
