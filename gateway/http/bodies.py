"""Reading a request's JSON body, with an error that says what is wrong.

The POST routes read their body here rather than through FastAPI's body parsing,
whose refusals say neither why nor, for some, anything OpenAI's clients expect
("There was an error parsing the body" with code null; "Input should be a valid
dictionary or object to extract fields from" for a JSON body sent as text/plain):

=====================================  ======  =====================================
body                                   status  message (code ``invalid_value`` for 400)
=====================================  ======  =====================================
``Content-Encoding`` other than        415     names the encoding
identity (gzip, br, …)
``Content-Type`` other than            415     names what was sent
``application/json`` (or ``+json``)
empty                                  400     "the body is empty"
not UTF-8 (RFC 8259: JSON is UTF-8)    400     the first bad byte's offset
not JSON                               400     the parser's reason, line and column
an integer of more than 4300 digits    400     names the cap (Python's int parsing)
nested deeper than the parser goes     400     "nested too deeply"
JSON but not an object                 400     names what it is
=====================================  ======  =====================================

A body sent with no ``Content-Type`` at all (or an empty one) is read as JSON, as
FastAPI (and so vLLM's server) reads it: a client that posts a JSON string without
the header works. A UTF-8 byte order mark before the JSON is skipped (RFC 8259
lets a parser ignore it, and Python's ``json.loads`` of bytes, which FastAPI uses,
does).
"""

from __future__ import annotations

import codecs
import json
import sys
from typing import Any

from fastapi import Request

from gateway.http.errors import HttpError, RequestRefused

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _invalid(message: str) -> RequestRefused:
    return RequestRefused(HttpError(400, message, "invalid_request_error", "invalid_value"))


def _unsupported(message: str) -> RequestRefused:
    return RequestRefused(HttpError(415, message, "invalid_request_error", "unsupported_media_type"))


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/")
                                                  and media_type.endswith("+json"))


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object.

    Raises:
        RequestRefused: 415 for an encoding or content type other than JSON's (none: JSON), 400
            (``invalid_value``) for a body that is empty, not UTF-8, not JSON or not an
            object (see the module table).
    """
    encodings = [e.strip().lower() for e in request.headers.get("content-encoding", "").split(",") if e.strip()]
    encoded = [e for e in encodings if e != "identity"]
    if encoded:
        raise _unsupported(f"Content-Encoding {encoded[0]!r} is not supported; send the body uncompressed")
    content_type = request.headers.get("content-type")
    if content_type and not _is_json(content_type):
        raise _unsupported(f"Content-Type must be application/json; got {content_type!r}")
    raw = await request.body()
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # a byte order mark first is skipped
    if len(raw) == bom:
        raise _invalid("the body is empty; send a JSON object")
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        raise _invalid(f"the body is not valid UTF-8: byte 0x{raw[at]:02x} at offset {at}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(f"the body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise _invalid("the body is not valid JSON: it is nested too deeply") from None
    except ValueError:  # Python's cap on the digits of an int it converts
        raise _invalid(f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(body, dict):
        raise _invalid(f"the body must be a JSON object, got {_JSON_KINDS.get(type(body), 'another value')}")
    return body
