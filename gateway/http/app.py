"""The gateway's HTTP application (FastAPI): the OpenAI routes, the task routes,
and what operators and load balancers read on the same port.

=====================  =========================================================
route                  answer
=====================  =========================================================
GET  /health           200 ``{"status": "ok"}`` while the process serves (liveness)
GET  /ready            200 while an executor serves, else 503 (readiness, as the
                       gateway's grpc.health.v1: ``gateway.readiness``)
GET  /ready/tasks      200 while the task store answers, else 503 (the task path's
                       readiness: ``gateway.task_readiness``)
GET  /metrics          the gateway's Prometheus metrics (text exposition format),
                       open mode only: with a tenants file it is 404 (the metrics
                       name every tenant; scrape ``--metrics-port``, not the API port)
GET  /version          ``{"version": meshserve's version}``
/v1/models[/{model}], /v1/completions, /v1/chat/completions   ``gateway.http.openai_routes``
/v1/tasks…             ``gateway.http.task_routes``
POST /tokenize, POST /detokenize   vLLM's tokenizer routes: ``gateway.http.tokenize_routes``
=====================  =========================================================

Every error is OpenAI's JSON error body (``gateway.http.errors``); a body over
``max_body_bytes`` is refused with 413 before it is read whole, and one
that stops arriving with 408 (``gateway.http.body_guards``).
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway.generation import GatewayCore
from gateway.http.body_guards import BODY_TIMEOUT_S, MAX_BODY_BYTES, BodyLimit, BodyTimeout
from gateway.http.errors import HttpError, RequestRefused, http_error, validation_error
from gateway.http.openai_routes import OpenAIRoutes
from gateway.http.task_routes import TaskRoutes
from gateway.http.tokenize_routes import TokenizeRoutes
from gateway.task_api import TaskAPI
from gateway.tenants import TenantRegistry
from meshserve import __version__
from meshserve.errors import MeshError


def create_app(core: GatewayCore, tenants: TenantRegistry, tasks: TaskAPI, ready: Callable[[], bool],
               registry: CollectorRegistry, max_body_bytes: int = MAX_BODY_BYTES,
               tasks_ready: Callable[[], bool] = lambda: True, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The application over a core.

    Args:
        core: the gateway core (shared with the gRPC adapter).
        tenants: API keys → tenants.
        tasks: the task adapter (shared with the gRPC adapter).
        ready: True while an executor serves (``ReadinessProbe.ready``).
        registry: the Prometheus registry ``/metrics`` serves (open mode only).
        max_body_bytes: a request body's most bytes.
        tasks_ready: True while the task store answers (``TaskStoreProbe``).
        body_timeout_s: the longest wait for the next part of an incomplete body
            (seconds; ``gateway.http.body_guards``).
    """
    app = FastAPI(title="meshserve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(OpenAIRoutes(core, tenants).router)
    app.include_router(TaskRoutes(tasks).router)
    app.include_router(TokenizeRoutes(core, tenants).router)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that only want the status
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready_route() -> JSONResponse:
        if ready():
            return JSONResponse({"status": "ready"})
        return HttpError(503, "no executor serves", "service_unavailable_error", "service_unavailable",
                         retry_after_s=1).response()

    @app.get("/ready/tasks")
    async def tasks_ready_route() -> JSONResponse:
        if tasks_ready():
            return JSONResponse({"status": "ready"})
        return HttpError(503, "the task store does not answer", "service_unavailable_error", "service_unavailable",
                         retry_after_s=1).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        if not tenants.open_mode:  # tenant names and traffic are not for every API key holder
            return HttpError(404, "/metrics is not served on the API port when a tenants file is in use; "
                             "scrape the gateway's --metrics-port", "invalid_request_error", "not_found").response()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def on_bad_task_body(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(RequestRefused)  # a body that is not a JSON object (gateway.http.bodies)
    async def on_refused(_: Request, exc: RequestRefused) -> JSONResponse:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        response = HttpError(exc.status_code, str(exc.detail), "invalid_request_error", code).response()
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110 requires its Allow: Starlette's names the first route's methods only
            response.headers["allow"] = ", ".join(sorted(_allowed_methods(app, request)))
        return response

    @app.exception_handler(MeshError)  # a domain error: answered, not re-raised as a server error
    async def on_mesh_error(_: Request, exc: MeshError) -> JSONResponse:
        return http_error(exc).response()

    @app.exception_handler(Exception)  # our bug: 500 (Starlette logs it)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return http_error(exc).response()

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BodyTimeout, timeout_s=body_timeout_s)
    return app



METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(app: FastAPI, request: Request) -> set[str]:
    """The methods some route takes on ``request``'s path (``/v1/tasks/{task_id}``: GET
    and DELETE, two routes), for a 405's ``Allow``: each method of ``METHODS`` tried
    against every route (routes of an included router hold no ``methods`` of their own)."""
    return {method for method in METHODS
            if any(route.matches(dict(request.scope, method=method))[0] == Match.FULL for route in app.router.routes)}
