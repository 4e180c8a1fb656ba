"""OpenTelemetry set-up and W3C trace-context propagation over gRPC metadata.

Each service process calls ``setup_tracing`` once at start. The exporter is chosen
by flag or by ``MESHSERVE_TRACES`` (read when ``setup_tracing`` runs, never at
import): ``none`` (default), ``console``, ``otlp`` (gRPC, endpoint from
``--otlp-endpoint`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, default localhost:4317) or
``memory`` (tests: spans kept in ``memory_exporter()``). The sampler is
``ParentBased(TraceIdRatioBased(ratio))``: a request whose caller sent a sampled
``traceparent`` is always traced; a root trace is kept with probability
``ratio`` (``--trace-sample-ratio`` / ``MESHSERVE_TRACE_SAMPLE_RATIO``, default 1).

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
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

EXPORTERS = ("none", "console", "otlp", "memory")
_memory = InMemorySpanExporter()
_configured: str | None = None


def memory_exporter() -> InMemorySpanExporter:
    """The process-wide in-memory exporter used with ``exporter="memory"``."""
    return _memory


def make_sampler(ratio: float | str | None = None) -> Sampler:
    """``ParentBased(TraceIdRatioBased(ratio))``: follows the caller's sampled flag;
    samples a fraction ``ratio`` of new root traces (by trace id, so every service
    takes the same decision).

    Args:
        ratio: in [0, 1]; None reads ``MESHSERVE_TRACE_SAMPLE_RATIO`` (default 1.0).

    Raises:
        ValueError: not a number in [0, 1].
    """
    if ratio is None:
        ratio = os.environ.get("MESHSERVE_TRACE_SAMPLE_RATIO") or 1.0
    try:
        value = float(ratio)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise ValueError(f"trace sample ratio must be a number in [0, 1], got {ratio!r}")
    return ParentBased(TraceIdRatioBased(value))


def setup_tracing(service: str, exporter: str | None = None, otlp_endpoint: str | None = None,
                  sample_ratio: float | None = None) -> None:
    """Installs the process's tracer provider once; later calls are no-ops.

    Args:
        service: ``service.name`` of the resource (gateway, scheduler, executor…).
        exporter: one of ``EXPORTERS``; None reads ``MESHSERVE_TRACES`` (default none).
        otlp_endpoint: host:port of an OTLP/gRPC collector for ``otlp``.
        sample_ratio: fraction of new root traces kept, in [0, 1] (``make_sampler``).

    Raises:
        ValueError: unknown exporter name; sample ratio outside [0, 1].
    """
    global _configured
    exporter = (exporter or os.environ.get("MESHSERVE_TRACES") or "none").lower()
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    sampler = make_sampler(sample_ratio)
    if _configured is not None:
        return
    _configured = exporter
    provider = TracerProvider(resource=Resource.create({"service.name": f"meshserve-{service}"}), sampler=sampler)
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


def record_error(span: trace.Span, exc: BaseException) -> None:
    """Marks ``span`` failed: the exception as an event, status ERROR with its message."""
    span.record_exception(exc)
    span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")


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
