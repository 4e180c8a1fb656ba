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


def validation_error(errors: list[dict]) -> HttpError:
    """A body pydantic refused (400), naming the first bad field as ``param``."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return HttpError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                         "invalid_request_error", "invalid_value")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request body").removeprefix("Value error, ")  # pydantic's wording of our ValueErrors
    message = f"{param}: {msg}" if param else msg
    return HttpError(400, message, "invalid_request_error", "invalid_value", param)
