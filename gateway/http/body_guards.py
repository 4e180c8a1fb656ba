"""ASGI middleware that bounds what a request body may cost before the routes see it.

===========  ======  =====================================================================
guard        status  when
===========  ======  =====================================================================
BodyLimit    413     the body is over ``max_bytes``: by its Content-Length at once, else
                     as soon as the bytes received pass it
BodyTimeout  408     the body stops arriving: no part of it for ``timeout_s`` seconds
                     while it is incomplete (a client that sends a Content-Length and
                     then less, or stalls mid-body, would otherwise hold its connection
                     and its request until it gives up; nginx's ``client_body_timeout``
                     does the same, 60 s by default)
===========  ======  =====================================================================

Both answer with OpenAI's error body (``gateway.http.errors``), then hand the route a
disconnect for the body it waits on; whatever the route answers after that is dropped.
An exception raised into the route instead would come back as FastAPI's 400 "error
parsing the body". A 408 also closes the connection (``Connection: close``): the rest of
its body may still come. Waiting for the client after its body (a streaming response's
disconnect watch) is never bounded.
"""

from __future__ import annotations

import asyncio

from gateway.http.errors import HttpError

MAX_BODY_BYTES = 8 << 20  # a request body's most bytes (8 MiB)
BODY_TIMEOUT_S = 30.0  # the longest wait for the next part of an incomplete body (seconds)


async def _guarded(app, scope, receive, send, refuse):
    """Runs ``app`` with ``receive`` (which may refuse, see the module docstring): once
    ``refuse`` was called, ``app``'s messages are dropped and its complaint is moot."""
    refused = False

    async def unless_refused(message):
        if not refused:
            await send(message)

    async def guarded_receive():
        nonlocal refused
        if refused:
            return {"type": "http.disconnect"}
        message, error = await receive()
        if error is not None:
            refused = True
            await refuse(error)
            return {"type": "http.disconnect"}
        return message

    try:
        await app(scope, guarded_receive, unless_refused)
    except Exception:
        if not refused:
            raise


class BodyLimit:
    """413 for a request body over ``max_bytes`` (see the module docstring).

    Args:
        app: the ASGI application.
        max_bytes: a body's most bytes.
    """

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> HttpError:
        return HttpError(413, f"request body is larger than {self.max_bytes} bytes", "invalid_request_error",
                         "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._error().response()(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    return message, self._error()
            return message, None

        await _guarded(self.app, scope, counted, send, lambda error: error.response()(scope, receive, send))


class BodyTimeout:
    """408 for a request body that stops arriving (see the module docstring).

    Args:
        app: the ASGI application.
        timeout_s: the longest wait for the next part of an incomplete body (seconds, > 0).

    Raises:
        ValueError: ``timeout_s`` <= 0.
    """

    def __init__(self, app, timeout_s: float = BODY_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        complete = False

        async def timed():
            nonlocal complete
            if complete:
                return await receive(), None
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                return None, HttpError(408, f"the request body stopped arriving: nothing for {self.timeout_s:g} s",
                                       "invalid_request_error", "timeout")
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message, None

        async def refuse(error: HttpError):
            response = error.response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)

        await _guarded(self.app, scope, timed, send, refuse)
