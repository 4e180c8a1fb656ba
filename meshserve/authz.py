"""The gate every call of a mesh server passes before its handler runs: the
caller's role, and a request that does not parse.

``GuardInterceptor`` sits after ``meshserve.errors.ErrorInterceptor`` (which
maps what it raises to status codes):

- **Role** (TLS servers only, ``table`` given): the caller's role is the
  ``spiffe://meshserve/<role>`` URI SAN of the client certificate that the TLS
  handshake verified against the CA (``context.auth_context()["peer_uri"]``).
  No role → UNAUTHENTICATED; a role the table does not allow for the method
  (``meshserve.roles``) → PERMISSION_DENIED. The handler does not run.
- **Malformed request** (every server): bytes that are not the method's request
  message → INVALID_ARGUMENT and one warning line naming the method and peer,
  instead of gRPC's UNKNOWN with a traceback per call. The request deserializer
  is wrapped so that a failure becomes a marker object the handler wrapper
  refuses; for client-streaming methods each message is checked as it is read.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, AsyncIterator, Callable, Mapping

import grpc

from meshserve.certs import ROLE_URI_PREFIX
from meshserve.errors import InvalidArgument, PermissionDenied, Unauthenticated
from meshserve.roles import PUBLIC

log = logging.getLogger(__name__)


class _Malformed:
    """Stands for a request message that did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and kin: the caller's bytes
            return _Malformed(f"{type(exc).__name__}: {exc}")

    return parse


def peer_roles(context: grpc.aio.ServicerContext) -> set[str]:
    """The roles named by the caller's verified certificate (empty: no certificate,
    or one without a ``spiffe://meshserve/<role>`` URI SAN)."""
    uris = context.auth_context().get("peer_uri", ())
    return {u.decode(errors="replace")[len(ROLE_URI_PREFIX):] for u in uris
            if u.startswith(ROLE_URI_PREFIX.encode())}


def _refuse_malformed(method: str, context: grpc.aio.ServicerContext, bad: _Malformed) -> InvalidArgument:
    log.warning("%s from %s: malformed request message (%s)", method, context.peer(), bad.error)
    return InvalidArgument(f"malformed request message for {method}: {bad.error}")


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Role check (with ``table``: method → allowed roles) and malformed-request
    check, before any handler runs (see the module docstring).

    Args:
        table: ``meshserve.roles.ROLE_TABLE`` on a TLS server; None on a plaintext
            one (no identities: no role check).
    """

    def __init__(self, table: Mapping[str, frozenset[str]] | None = None):
        self.table = table

    def _check_role(self, method: str, context: grpc.aio.ServicerContext) -> None:
        allowed = self.table.get(method, frozenset())
        if allowed is PUBLIC or "*" in allowed:
            return
        roles = peer_roles(context)
        if not roles:
            log.warning("%s from %s: refused, no role certificate", method, context.peer())
            raise Unauthenticated(f"{method} needs a client certificate naming a meshserve role")
        if not roles & allowed:
            log.warning("%s from %s: refused to role %s", method, context.peer(), ",".join(sorted(roles)))
            may = ", ".join(sorted(allowed)) or "no role"
            raise PermissionDenied(f"role {','.join(sorted(roles))} may not call {method} (allowed: {may})")

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        check = self._check_role if self.table is not None else None

        def gate(request: Any, context: grpc.aio.ServicerContext) -> None:
            if check is not None:
                check(method, context)
            if isinstance(request, _Malformed):
                raise _refuse_malformed(method, context, request)

        async def requests(iterator: AsyncIterator[Any], context) -> AsyncIterator[Any]:
            async for msg in iterator:
                if isinstance(msg, _Malformed):
                    raise _refuse_malformed(method, context, msg)
                yield msg

        def unary_in(fn):
            async def run(request, context):
                gate(request, context)
                return await fn(request, context)
            return run

        def unary_in_stream_out(fn):
            if not inspect.isasyncgenfunction(fn):  # writes with context.write (health's Watch)
                return unary_in(fn)

            async def run(request, context):
                gate(request, context)
                async for item in fn(request, context):
                    yield item
            return run

        def stream_in(fn):
            async def run(request_iterator, context):
                gate(None, context)
                return await fn(requests(request_iterator, context), context)
            return run

        def stream_in_stream_out(fn):
            if not inspect.isasyncgenfunction(fn):
                return stream_in(fn)

            async def run(request_iterator, context):
                gate(None, context)
                async for item in fn(requests(request_iterator, context), context):
                    yield item
            return run

        kw = dict(request_deserializer=_tolerant(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary_in(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(unary_in_stream_out(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_in(handler.stream_unary), **kw)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(stream_in_stream_out(handler.stream_stream), **kw)
        return handler
