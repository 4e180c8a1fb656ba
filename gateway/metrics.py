"""The gateway's Prometheus metrics: what a caller sees of each request, labelled
by tenant and priority (both bounded, ``meshserve.metrics.BoundedLabel``).

=============================================  =========  =========================================
metric                                         type       observed
=============================================  =========  =========================================
meshserve_request_queue_seconds                histogram  arrival → the scheduler's assignment
meshserve_request_ttft_seconds                 histogram  arrival → first token of any choice; once
                                                          per request that produced a token
meshserve_request_tpot_seconds                 histogram  per choice of >= 2 tokens: (last − first
                                                          token) / (tokens − 1)
meshserve_request_e2e_seconds                  histogram  arrival → end, every request
meshserve_request_prompt_tokens_total          counter    prompt tokens of every valid request
meshserve_request_generation_tokens_total      counter    tokens streamed, all choices
meshserve_requests_total{outcome}              counter    every request at its end: ``ok``, or the
                                                          status code's name (``invalid_argument``…)
meshserve_gateway_requests_running             gauge      requests in flight
=============================================  =========  =========================================

"Every request" is every authenticated one (a missing or unknown API key is
refused before a tenant is known). One ``RequestMetrics`` follows one request;
its methods are idempotent where a request could call twice (TTFT, end), so
each request is observed exactly once.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.errors import MeshError
from meshserve.metrics import (DEFAULT_MAX_PRIORITY_LABELS, DEFAULT_MAX_TENANT_LABELS, LATENCY_BUCKETS, TPOT_BUCKETS,
                               BoundedLabel, new_registry)

LABELS = ("tenant", "priority")


def outcome_of(exc: BaseException | None) -> str:
    """The ``outcome`` label of a request that ended with ``exc`` (None: ``ok``):
    the lower-case gRPC status name of a domain error, ``cancelled`` for a caller
    gone, ``internal`` for anything else."""
    if exc is None:
        return "ok"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    if isinstance(exc, MeshError):
        return exc.code.name.lower()
    code = getattr(exc, "code", None)  # grpc.aio.AioRpcError passed through
    return code().name.lower() if callable(code) else "internal"


class GatewayMetrics:
    """The gateway's metric objects in one registry.

    Args:
        registry: where to register (default: a new ``new_registry("gateway")``).
        max_tenants: distinct tenant label values; later tenants are ``other``.
        max_priorities: distinct priority label values; later ones are ``other``.
    """

    def __init__(self, registry: CollectorRegistry | None = None, max_tenants: int = DEFAULT_MAX_TENANT_LABELS,
                 max_priorities: int = DEFAULT_MAX_PRIORITY_LABELS):
        self.registry = registry if registry is not None else new_registry("gateway")
        self.tenant_label = BoundedLabel(max_tenants)
        self.priority_label = BoundedLabel(max_priorities)
        r = self.registry
        self.queue = Histogram("meshserve_request_queue_seconds", "Arrival to the scheduler's assignment.",
                               LABELS, registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("meshserve_request_ttft_seconds", "Arrival to the first token (time to first token).",
                              LABELS, registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("meshserve_request_tpot_seconds", "Inter-token latency of a choice (time per output "
                              "token after the first).", LABELS, registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("meshserve_request_e2e_seconds", "Arrival to the end of the request.", LABELS,
                             registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("meshserve_request_prompt_tokens", "Prompt tokens of finished requests.",
                                     LABELS, registry=r)
        self.generation_tokens = Counter("meshserve_request_generation_tokens", "Tokens streamed to callers.",
                                         LABELS, registry=r)
        self.requests = Counter("meshserve_requests", "Requests by outcome.", LABELS + ("outcome",), registry=r)
        self.running = Gauge("meshserve_gateway_requests_running", "Requests in flight.", LABELS, registry=r)

    def start(self, tenant: str, priority: int, started_at: float) -> "RequestMetrics":
        """Begins following one request that arrived at ``started_at`` (monotonic seconds)."""
        return RequestMetrics(self, (self.tenant_label(tenant), self.priority_label(priority)), started_at)


class RequestMetrics:
    """One request's observations (see ``GatewayMetrics``)."""

    def __init__(self, metrics: GatewayMetrics, labels: tuple[str, str], started_at: float):
        self._m, self.labels, self.started_at = metrics, labels, started_at
        self.num_prompt_tokens = 0  # set once the prompt is built
        self.num_generation_tokens = 0  # added as tokens stream (``tokens``)
        self.ttft_observed = False
        self._ended = False
        metrics.running.labels(*labels).inc()

    def assigned(self, at: float) -> None:
        """The scheduler assigned an executor at ``at`` (monotonic seconds)."""
        self._m.queue.labels(*self.labels).observe(at - self.started_at)

    def tokens(self, n: int) -> None:
        """``n`` tokens were streamed to the caller."""
        self.num_generation_tokens += n

    def first_token(self, at: float) -> None:
        """A token arrived at ``at``; only the first call observes TTFT."""
        if not self.ttft_observed:
            self.ttft_observed = True
            self._m.ttft.labels(*self.labels).observe(at - self.started_at)

    def choice_done(self, num_tokens: int, first_at: float, last_at: float) -> None:
        """A choice ended with ``num_tokens`` tokens, first and last at these times."""
        if num_tokens > 1:
            self._m.tpot.labels(*self.labels).observe((last_at - first_at) / (num_tokens - 1))

    def end(self, at: float, exc: BaseException | None = None) -> None:
        """The request ended at ``at`` (``exc``: what ended it, None when it succeeded);
        only the first call counts."""
        if self._ended:
            return
        self._ended = True
        m = self._m
        m.running.labels(*self.labels).dec()
        m.e2e.labels(*self.labels).observe(at - self.started_at)
        m.prompt_tokens.labels(*self.labels).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(*self.labels).inc(self.num_generation_tokens)
        m.requests.labels(*self.labels, outcome_of(exc)).inc()
