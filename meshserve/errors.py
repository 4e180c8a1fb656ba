"""Domain errors and the one server interceptor that maps them to gRPC status codes.

Cores raise these exceptions; they never import grpc status handling themselves.
``ErrorInterceptor`` turns each into its status code with the exception's message;
any other exception is our own bug and becomes INTERNAL (and is logged).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)


class MeshError(Exception):
    """Base of the errors that carry a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(MeshError, ValueError):
    """The caller sent a bad parameter; the message names the field or limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(MeshError):
    """Quota or overload; ``retry_after_s`` tells when to try again (seconds), None
    when the same request will never fit (it alone exceeds its tenant's quota)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AlreadyExists(MeshError):
    """The caller reused the id of a request that is still in flight."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Cancelled(MeshError):
    """The caller withdrew the request (e.g. released its proposed lease id while queued)."""

    code = grpc.StatusCode.CANCELLED


class Unavailable(MeshError):
    """No executor (or another service) can take the request now."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(MeshError):
    """Missing or unknown API key."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    """The tenant may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(MeshError):
    """Unknown task, lease or request."""

    code = grpc.StatusCode.NOT_FOUND


class ModelNotFound(NotFound):
    """The request names a model the gateway does not serve (OpenAI's ``model_not_found``)."""


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, MeshError):
        if isinstance(exc, ResourceExhausted) and exc.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after-s", f"{exc.retry_after_s:.3f}"),))
        await context.abort(exc.code, str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _wrap_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await _abort(context, exc)

    return wrapper


def _wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(fn):  # writes with context.write (health's Watch): awaited, not iterated
        return _wrap_unary(fn)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in fn(request, context):
                yield item
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await _abort(context, exc)

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``MeshError`` subclasses to their status code, anything else to INTERNAL."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument, ResourceExhausted, AlreadyExists, Unavailable, Unauthenticated, PermissionDenied, NotFound
    )
}


def from_rpc_error(exc: grpc.aio.AioRpcError, service: str) -> MeshError:
    """Re-raises an upstream call's failure with the same status code and message.

    Codes without a domain class (DEADLINE_EXCEEDED, INTERNAL…) keep their code;
    a lost connection stays UNAVAILABLE; RESOURCE_EXHAUSTED keeps its retry delay.
    """
    cls = _BY_CODE.get(exc.code())
    message = f"{service}: {exc.details()}"
    if cls is None:
        err = MeshError(message)
        err.code = exc.code()
        return err
    if cls is ResourceExhausted:
        return ResourceExhausted(message, _retry_after_s(exc))
    return cls(message)


def _retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """The ``retry-after-s`` trailing metadata of a RESOURCE_EXHAUSTED call; None when
    absent (a refusal that a retry will not change, e.g. gRPC's own message-size limit)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-s":
            try:
                return float(value)
            except ValueError:
                return 1.0  # a delay was meant: the default one
    return None
