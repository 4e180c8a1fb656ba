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

import grpc
from fastapi.responses import JSONResponse

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


_FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[\d+\]|\.[a-z_][a-z0-9_]*)*")


def _param_of(message: str) -> str | None:
    """The field an InvalidArgument message names first, in the body's dotted form as
    pydantic's errors give it (``"top_p must be…"`` → ``top_p``;
    ``"chat.messages[0].role must…"`` → ``messages.0.role``: the gRPC request's
    ``chat`` is the body's ``messages``)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if not _FIELD_PATH.fullmatch(first):
        return None
    return re.sub(r"\[(\d+)\]", r".\1", first).removeprefix("chat.")


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
    for cls, status, kind, code in _BY_CLASS:
        if isinstance(exc, cls):
            param = "model" if cls is ModelNotFound else _param_of(message) if cls is InvalidArgument else None
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
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}
_TYPE_NAME = re.compile(r"[A-Z]\w*|.*[\[\-].*")  # ContentPart, list[int], function-after[...]


def _is_tag(part) -> bool:
    """Whether a pydantic location part names a union member (``str``, ``list[int]``,
    ``ContentPart``, ``function-after[…]``) rather than a field or an index."""
    return isinstance(part, str) and (part in _TYPE_NAMES or bool(_TYPE_NAME.fullmatch(part)))


def _path(loc) -> list:
    """A location without ``body`` and the union members' type names."""
    return [p for p in loc if p != "body" and not _is_tag(p)]


def _message(param: str | None, msg: str) -> HttpError:
    msg = msg.removeprefix("Value error, ")  # pydantic's wording of our ValueErrors
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
    loc = tuple(first.get("loc", ()))
    tag_at = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
    if tag_at is None:
        return _message(".".join(str(p) for p in _path(loc)) or None, first.get("msg", "invalid request body"))
    field = loc[:tag_at]
    param = ".".join(str(p) for p in _path(field)) or None
    members: dict[str, list[dict]] = {}  # the union's members, each with its errors
    for error in errors:
        e_loc = tuple(error.get("loc", ()))
        if e_loc[:tag_at] == field and len(e_loc) > tag_at and _is_tag(e_loc[tag_at]):
            members.setdefault(e_loc[tag_at], []).append(error)
    inside = [errs for errs in members.values() if any(len(e["loc"]) > tag_at + 1 for e in errs)]
    if len(inside) == 1:  # the value has one member's shape: that member's complaint is the one that helps
        error = next(e for e in inside[0] if len(e["loc"]) > tag_at + 1)
        return _message(".".join(str(p) for p in _path(error["loc"])), error.get("msg", ""))
    forms = _UNION_FORMS.get(".".join(p for p in _path(field) if isinstance(p, str)),
                             ", ".join(members) or "another type")
    return _message(param, f"Input should be {forms}")
