"""OpenTelemetry set-up and W3C trace-context propagation over gRPC metadata.

Each service process calls ``setup_tracing`` once at start. The exporter is chosen
by flag or by ``MESHSERVE_TRACES`` (read when ``setup_tracing`` runs, never at
import): ``none`` (default), ``console``, ``otlp`` (gRPC, endpoint from
``--otlp-endpoint`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, default localhost:4317) or
``memory`` (tests: spans kept in ``memory_exporter()``).

Every outgoing call carries ``traceparent``/``tracestate`` metadata made by
``outgoing_metadata()``; every servicer opens its span with
``context_from_grpc(context)`` as parent, so one request is one trace from the
gateway to the last executor step.
"""

from __future__ import annotations

import os
from typing import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTERS = ("none", "console", "otlp", "memory")
_memory = InMemorySpanExporter()
_configured: str | None = None


def memory_exporter() -> InMemorySpanExporter:
    """The process-wide in-memory exporter used with ``exporter="memory"``."""
    return _memory


def setup_tracing(service: str, exporter: str | None = None, otlp_endpoint: str | None = None) -> None:
    """Installs the process's tracer provider once; later calls are no-ops.

    Args:
        service: ``service.name`` of the resource (gateway, scheduler, executor…).
        exporter: one of ``EXPORTERS``; None reads ``MESHSERVE_TRACES`` (default none).
        otlp_endpoint: host:port of an OTLP/gRPC collector for ``otlp``.

    Raises:
        ValueError: unknown exporter name.
    """
    global _configured
    exporter = (exporter or os.environ.get("MESHSERVE_TRACES") or "none").lower()
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    if _configured is not None:
        return
    _configured = exporter
    provider = TracerProvider(resource=Resource.create({"service.name": f"meshserve-{service}"}))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "memory":
        provider.add_span_processor(SimpleSpanProcessor(_memory))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    """Flushes and shuts the provider down (at service stop)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    """The tracer of a module (``tracer(__name__)``)."""
    return trace.get_tracer(name)


def outgoing_metadata(span: trace.Span | None = None,
                      extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``span``'s W3C context (default: the current span's), plus ``extra``.

    Servicers that are async generators pass their span explicitly instead of
    attaching it as the current context: a generator closed from another task
    cannot detach a context token it attached.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return tuple(extra) + tuple(carrier.items())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The remote parent context carried in incoming gRPC metadata (or an empty one)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def context_from_grpc(servicer_context) -> otel_context.Context:
    """The remote parent context of a call being served (``grpc.aio.ServicerContext``)."""
    return context_from_metadata(servicer_context.invocation_metadata())
