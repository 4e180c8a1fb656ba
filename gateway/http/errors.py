"""Errors of the HTTP adapter in OpenAI's JSON shape.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status its cause calls for:

=====================  ======  ==========================  =====================
domain error           status  type                        code
=====================  ======  ==========================  =====================
InvalidArgument, body  400     invalid_request_error       invalid_value / null
Unauthenticated        401     authentication_error        invalid_api_key
PermissionDenied       403     permission_error            null
ModelNotFound          404     invalid_request_error       model_not_found
NotFound (a task)      404     invalid_request_error       not_found
AlreadyExists          409     invalid_request_error       conflict
body too large         413     invalid_request_error       request_too_large
body not JSON          415     invalid_request_error       unsupported_media_type
ResourceExhausted      429     rate_limit_error            rate_limit_exceeded (+ Retry-After)
 … with no retry delay 429     insufficient_quota          insufficient_quota (+ x-should-retry: false)
Unavailable            503     service_unavailable_error   service_unavailable (+ Retry-After: 1)
DEADLINE_EXCEEDED      504     timeout_error               timeout
anything else          500     internal_error              null (our bug, logged)
=====================  ======  ==========================  =====================

``Retry-After`` is in whole seconds, rounded up (RFC 9110). Once a stream has
started its status is sent, so a later error is one SSE event holding the same
body, then ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from meshserve.errors import (AlreadyExists, InvalidArgument, MeshError, ModelNotFound, NotFound, PermissionDenied,
                              ResourceExhausted, Unauthenticated, Unavailable)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpError:
    """One error as HTTP: status, OpenAI body fields, extra headers."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None
    final: bool = False  # retrying the same request never helps: ``x-should-retry: false`` (OpenAI's clients)

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response (with ``Retry-After`` when set, ``x-should-retry: false`` when final)."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.final:
            headers["x-should-retry"] = "false"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


class RequestRefused(Exception):
    """Raised by the HTTP adapter with the error to answer (``gateway.http.bodies``)."""

    def __init__(self, error: HttpError):
        super().__init__(error.message)
        self.error = error


_BY_CLASS: list[tuple[type[MeshError], int, str, str | None]] = [
    (ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (NotFound, 404, "invalid_request_error", "not_found"),
    (InvalidArgument, 400, "invalid_request_error", "invalid_value"),
    (Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (PermissionDenied, 403, "permission_error", None),
    (AlreadyExists, 409, "invalid_request_error", "conflict"),
]
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
}


_FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[-?\d+\]|\.[a-z_][a-z0-9_]*)*")


def _param_of(message: str) -> str | None:
    """The field an InvalidArgument message names first, in the body's dotted form as
    pydantic's errors give it (``"top_p must be…"`` → ``top_p``;
    ``"messages[0].role must…"`` → ``messages.0.role``; ``"logit_bias[-1]: …"`` →
    ``logit_bias.-1``, the key as sent; ``http_error`` has already renamed the gRPC
    request's ``chat.messages`` to the body's ``messages``)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if not _FIELD_PATH.fullmatch(first):
        return None
    return re.sub(r"\[(-?\d+)\]", r".\1", first)


def http_error(exc: BaseException) -> HttpError:
    """The HTTP form of an exception (see the module table); unknown ones are logged."""
    message = str(exc)
    if isinstance(exc, ResourceExhausted):
        if exc.retry_after_s is None:  # it never fits its tenant's quota: retrying does not help
            return HttpError(429, message, "insufficient_quota", "insufficient_quota", final=True)
        return HttpError(429, message, "rate_limit_error", "rate_limit_exceeded",
                         retry_after_s=max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, Unavailable):
        return HttpError(503, message, "service_unavailable_error", "service_unavailable", retry_after_s=1)
    if isinstance(exc, InvalidArgument):
        message = message.removeprefix("chat.")  # the gRPC request's chat is the body's messages
    for cls, status, kind, code in _BY_CLASS:
        if isinstance(exc, cls):
            param = "model" if cls is ModelNotFound else _param_of(message) if cls in (InvalidArgument, AlreadyExists) \
                else None
            return HttpError(status, message, kind, code, param)
    if isinstance(exc, MeshError):
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return HttpError(429, message, "rate_limit_error", "rate_limit_exceeded", retry_after_s=1)
        if exc.code == grpc.StatusCode.UNAVAILABLE:
            return HttpError(503, message, "service_unavailable_error", "service_unavailable", retry_after_s=1)
        status, kind, code = _BY_CODE.get(exc.code, (500, "internal_error", None))
        return HttpError(status, message, kind, code)
    log.error("internal error", exc_info=exc)
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


# What each union field of the bodies takes, for the one message a value none of its forms fits gets
# (keyed by the field's path without list indices).
_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages.content": "a string, a list of text parts or null",
    "tool_choice": "a string or an object",
    "function_call": "a string or an object",
    "structured_outputs.json": "a JSON Schema (an object) or its JSON text (a string)",
}


def union_paths(annotation, path: tuple[str, ...] = ()) -> set[str]:
    """The dotted field paths (names only, no list indices) under ``annotation`` (a body
    model) that hold a union of more than one non-null type: where pydantic puts a member's
    name (``str``, ``list[int]``) in an error's location, right after the field's name and
    its indices. Inside a member the path goes on after a ``|`` (``a.|.b``). A dict's values
    are not walked: a dict key in a location is the caller's, never a member's name."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:  # StrictInt: int with its constraints
        return union_paths(args[0], path)
    if origin in (Union, UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # ``X | None``: nullable, not a union (no name in the location)
            return union_paths(members[0], path)
        return {".".join(path)}.union(*(union_paths(m, (*path, "|")) for m in members))
    if origin in (list, tuple, set, frozenset):
        return set().union(*(union_paths(a, path) for a in args if a is not Ellipsis))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return set().union(*(union_paths(f.annotation, (*path, f.alias or name))
                             for name, f in annotation.model_fields.items()))
    return set()


_UNION_PATHS = union_paths(ChatCompletionRequest) | union_paths(CompletionRequest)


def _tag_positions(loc) -> list[int]:
    """The positions in a pydantic location (without FastAPI's leading ``body``) of union
    members' names: each part right after a union field's name (and its indices), found
    from the body models' fields, not from how the part looks (a ``logit_bias`` key
    ``Abc`` or ``a-b`` is a key)."""
    field: list[str] = []
    tags = []
    for i, part in enumerate(loc):
        if not isinstance(part, str):
            continue  # a list index
        if ".".join(field) in _UNION_PATHS:
            tags.append(i)
            field.append("|")
        else:
            field.append(part)
    return tags


def _path(loc) -> list:
    """A location without the union members' names."""
    tags = _tag_positions(loc)
    return [p for i, p in enumerate(loc) if i not in tags]


def _without_body(loc) -> tuple:
    """A location without FastAPI's leading ``body`` (a body model has no field of that name)."""
    loc = tuple(loc)
    return loc[1:] if loc[:1] == ("body",) else loc


_MODEL_INSTANCE = re.compile(r"a valid dictionary(?: or instance of \w+)?")  # Python's words, and our classes' names


def _message(param: str | None, msg: str) -> HttpError:
    msg = msg.removeprefix("Value error, ")  # pydantic's wording of our ValueErrors
    msg = _MODEL_INSTANCE.sub("an object", msg)  # JSON's word, not a Python class's name
    return HttpError(400, f"{param}: {msg}" if param else msg, "invalid_request_error", "invalid_value", param)


def validation_error(errors: list[dict]) -> HttpError:
    """A body pydantic refused (400), naming the first bad field as ``param`` in the
    body's dotted form (``messages.0.content``), without the type names pydantic puts
    in a union's locations. A value that fits none of a union field's forms gets one
    message listing them; one that fits a form's shape only (a list, with a bad
    element) gets that form's error (``stop.0: Input should be a valid string``)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return HttpError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                         "invalid_request_error", "invalid_value")
    loc = _without_body(first.get("loc", ()))
    tags = _tag_positions(loc)
    if not tags:
        return _message(".".join(str(p) for p in loc) or None, first.get("msg", "invalid request body"))
    tag_at = tags[0]
    field = loc[:tag_at]
    param = ".".join(str(p) for p in field) or None
    members: dict[str, list[tuple]] = {}  # the union's members, each with its errors' locations and messages
    for error in errors:
        e_loc = _without_body(error.get("loc", ()))
        if e_loc[:tag_at] == field and len(e_loc) > tag_at:  # the same union: the part at tag_at is a member's
            members.setdefault(e_loc[tag_at], []).append((e_loc, error.get("msg", "")))
    inside = [errs for errs in members.values() if any(len(e_loc) > tag_at + 1 for e_loc, _ in errs)]
    if len(inside) == 1:  # the value has one member's shape: that member's complaint is the one that helps
        e_loc, msg = next((e_loc, msg) for e_loc, msg in inside[0] if len(e_loc) > tag_at + 1)
        return _message(".".join(str(p) for p in _path(e_loc)), msg)
    forms = _UNION_FORMS.get(".".join(p for p in field if isinstance(p, str)),
                             ", ".join(members) or "another type")
    return _message(param, f"Input should be {forms}")
