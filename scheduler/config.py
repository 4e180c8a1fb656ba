"""The scheduler's admission settings (``SchedulerConfig``).

Plain data: ``meshserve scheduler`` builds them from its flags and tenants file,
the simulators and tests from keywords; the admission core
(``scheduler.admission.AdmissionCore``) reads them and hands each policy its own
(``scheduler.admission_queue``, ``scheduler.lease_table``, ``scheduler.placement``,
``scheduler.queue_policy``, ``scheduler.quotas``, ``scheduler.tenant_limits``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from scheduler.pools import PoolsConfig
from scheduler.routing import RoutingConfig
from scheduler.tenant_limits import TenantLimits


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission settings.

    Attributes:
        max_queue_len: requests the queue holds before RESOURCE_EXHAUSTED.
        max_queue_tokens: queued prompt tokens (``n * num_prompt_tokens``
            summed) before RESOURCE_EXHAUSTED; None: no bound.
        pending_timeout_s: seconds a lease counts as pending before the executor
            reports it (see ``scheduler.registry``).
        retry_after_s: smallest retry delay suggested with RESOURCE_EXHAUSTED
            (seconds).
        queue_policy: ``fcfs``, ``priority`` or ``sjf`` (``scheduler.queue_policy``).
        max_queue_wait_s: the aging bound of ``sjf`` (seconds).
        tenant_quotas: tenant → ``kv_quota_blocks`` (absent or None: no quota).
        predictor_min_samples: observations a predictor level needs.
        pools: priority classes → pools and spill rules (``scheduler.pools``);
            None: every executor of the model is a candidate.
        routing: the routing cost function's settings (``scheduler.routing``).
        max_engine_waiting: an executor reporting more requests than this
            waiting in its engine gets no new assignment (None: no limit).
        kv_reservation: ``prompt`` or ``predicted``: whether room for a request
            counts its predicted output blocks and the predicted growth of the
            executor's leases (``scheduler.placement``).
        executor_timeout_s: an executor silent this long on its Connect stream
            (no report; they come at least every second) is dropped from the
            registry: nothing is routed to an unreachable executor (seconds).
        lease_ttl_s: a lease not renewed this long, and not listed by its
            executor, is released (seconds; ``scheduler.lease_table``).
        start_budget_s: scale to zero: how long a request waits for an executor
            of its model to register when none does (seconds;
            ``scheduler.admission``); None: UNAVAILABLE at once.
        tenant_limits: tenant → its limits (``scheduler.tenant_limits``); None:
            any tenant is admitted, unlimited (the core's tests); the
            ``meshserve scheduler`` command always sets it (the tenants file,
            or the ``default`` tenant alone).
    """

    max_queue_len: int = 4096
    max_queue_tokens: int | None = None
    pending_timeout_s: float = 10.0
    retry_after_s: float = 1.0
    queue_policy: str = "fcfs"
    max_queue_wait_s: float = 30.0
    tenant_quotas: Mapping[str, int | None] = field(default_factory=dict)
    predictor_min_samples: int = 3
    pools: PoolsConfig | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    max_engine_waiting: int | None = 0
    kv_reservation: str = "prompt"
    executor_timeout_s: float = 3.0
    lease_ttl_s: float = 10.0
    tenant_limits: Mapping[str, TenantLimits] | None = None
    start_budget_s: float | None = None
