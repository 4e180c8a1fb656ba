"""The scheduler's Prometheus metrics: the admission queue, leases, executors and
the output-length predictor, labelled by tenant and priority where a request is
involved (both bounded, ``meshserve.metrics.BoundedLabel``).

===============================================  =========  ==========================================
metric                                           type       observed
===============================================  =========  ==========================================
meshserve_scheduler_queue_seconds                histogram  Admit → assignment, per assigned request
meshserve_scheduler_requests_admitted_total      counter    assignments handed to the gateway
meshserve_scheduler_requests_rejected_total      counter    Admit calls refused or displaced, by
                                                            ``code`` (resource_exhausted, unavailable…)
meshserve_scheduler_requests_waiting             gauge      queued requests now (at scrape)
meshserve_scheduler_queue_tokens                 gauge      queued prompt tokens now
meshserve_scheduler_requests_running             gauge      leases held now
meshserve_scheduler_executors                    gauge      executors registered now
meshserve_scheduler_executor_free_blocks         gauge      free KV blocks the executors reported
meshserve_scheduler_predictor_observed_total     counter    finished choices the predictor learnt
meshserve_scheduler_predictor_abs_error_tokens   gauge      mean |predicted − actual| output tokens
meshserve_scheduler_desired_executors            gauge      the planner's executor count (KEDA/HPA
                                                            scale on it; ``scheduler.planner``)
meshserve_scheduler_load_tokens_per_second       gauge      the last planner interval's token load
meshserve_scheduler_forecast_tokens_per_second   gauge      largest forecast token load in the lead
meshserve_scheduler_forecast_requests_per_second gauge      largest forecast arrival rate in the lead
meshserve_scheduler_executor_capacity_tokens_per_second  gauge  one executor's measured capacity
meshserve_scheduler_cold_start_seconds           gauge      the cold start the planner leads by
meshserve_scheduler_executors_draining           gauge      executors draining now
===============================================  =========  ==========================================
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from meshserve.metrics import (DEFAULT_MAX_PRIORITY_LABELS, DEFAULT_MAX_TENANT_LABELS, LATENCY_BUCKETS, BoundedLabel,
                               new_registry, snapshot)
from scheduler.admission import AdmissionCore
from scheduler.planner import Planner

LABELS = ("tenant", "priority")


class SchedulerMetrics(Collector):
    """The scheduler's metrics over one ``AdmissionCore`` (read at scrape time) plus
    the per-request ones the servicer observes.

    Args:
        core: the admission core (read from the event loop's thread and the scrape
            thread: only lengths and sums of its containers are read).
        registry: where to register (default: a new ``new_registry("scheduler")``).
        max_tenants, max_priorities: distinct label values kept; the rest are ``other``.
        planner: the planner whose last decision is exported (None: no planner metrics).
    """

    def __init__(self, core: AdmissionCore, registry: CollectorRegistry | None = None,
                 max_tenants: int = DEFAULT_MAX_TENANT_LABELS, max_priorities: int = DEFAULT_MAX_PRIORITY_LABELS,
                 planner: Planner | None = None):
        self.core = core
        self.planner = planner
        self.registry = registry if registry is not None else new_registry("scheduler")
        self.tenant_label = BoundedLabel(max_tenants)
        self.priority_label = BoundedLabel(max_priorities)
        r = self.registry
        self.queue = Histogram("meshserve_scheduler_queue_seconds", "Admit to assignment.", LABELS, registry=r,
                               buckets=LATENCY_BUCKETS)
        self.admitted = Counter("meshserve_scheduler_requests_admitted", "Requests assigned to an executor.",
                                LABELS, registry=r)
        self.rejected = Counter("meshserve_scheduler_requests_rejected", "Admit calls refused or displaced.",
                                LABELS + ("code",), registry=r)
        r.register(self)

    def labels(self, tenant: str, priority: int) -> tuple[str, str]:
        """The bounded label values of a request."""
        return self.tenant_label(tenant or "default"), self.priority_label(priority)

    def on_assigned(self, tenant: str, priority: int, queue_s: float) -> None:
        """A request got its lease after ``queue_s`` seconds in the queue."""
        labels = self.labels(tenant, priority)
        self.queue.labels(*labels).observe(queue_s)
        self.admitted.labels(*labels).inc()

    def on_rejected(self, tenant: str, priority: int, exc: BaseException) -> None:
        """An Admit call failed with ``exc`` (a ``MeshError``: its code names it)."""
        code = getattr(exc, "code", None)
        self.rejected.labels(*self.labels(tenant, priority), code.name.lower() if code else "internal").inc()

    def collect(self) -> Iterator:
        core = self.core
        queued, executors = snapshot(lambda: (core.queued(), list(core.registry)))
        waiting = GaugeMetricFamily("meshserve_scheduler_requests_waiting", "Requests queued now.",
                                    labels=list(LABELS))
        counts: dict[tuple[str, str], int] = {}
        for req in queued:
            key = self.labels(req.tenant, req.priority)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            waiting.add_metric(list(key), n)
        yield waiting
        yield GaugeMetricFamily("meshserve_scheduler_queue_tokens", "Prompt tokens queued now.",
                                value=sum(r.queued_tokens for r in queued))
        yield GaugeMetricFamily("meshserve_scheduler_requests_running", "Leases held now.", value=core.num_leases())
        yield GaugeMetricFamily("meshserve_scheduler_executors", "Executors registered now.", value=len(executors))
        free = GaugeMetricFamily("meshserve_scheduler_executor_free_blocks", "Free KV blocks an executor reported.",
                                 labels=["executor_id"])
        for e in executors:
            free.add_metric([e.executor_id], e.num_free_blocks)
        yield free
        stats = core.predictor.stats()
        yield CounterMetricFamily("meshserve_scheduler_predictor_observed", "Finished choices the output-length "
                                  "predictor learnt from.", value=stats["num_observed"])
        yield GaugeMetricFamily("meshserve_scheduler_predictor_abs_error_tokens", "Mean absolute error of the "
                                "output-length predictions (tokens; 0 before any).",
                                value=stats["mean_abs_error_tokens"] or 0.0)
        yield GaugeMetricFamily("meshserve_scheduler_executors_draining", "Executors draining now.",
                                value=sum(e.draining for e in executors))
        yield from self._planner_metrics()

    def _planner_metrics(self) -> Iterator:
        decision = self.planner.last if self.planner is not None else None
        if decision is None:
            return
        yield GaugeMetricFamily("meshserve_scheduler_desired_executors", "Executors the planner wants now "
                                "(forecast led by the cold start, reactive floor, stabilized).", value=decision.desired)
        yield GaugeMetricFamily("meshserve_scheduler_load_tokens_per_second", "Token load of the planner's last "
                                "closed interval (what the reactive floor sizes).", value=decision.load_tokens_per_s)
        yield GaugeMetricFamily("meshserve_scheduler_forecast_tokens_per_second", "Largest forecast token load "
                                "within the planner's lead (0 without a forecast).",
                                value=decision.forecast_tokens_per_s)
        yield GaugeMetricFamily("meshserve_scheduler_forecast_requests_per_second", "Largest forecast arrival "
                                "rate within the planner's lead (0 without a forecast).",
                                value=decision.forecast_requests_per_s)
        yield GaugeMetricFamily("meshserve_scheduler_executor_capacity_tokens_per_second", "One executor's "
                                "capacity the planner uses (measured when saturated).",
                                value=decision.capacity_tokens_per_s)
        yield GaugeMetricFamily("meshserve_scheduler_cold_start_seconds", "Executor cold start the planner "
                                "leads by (measured at registration).", value=decision.cold_start_s)

