"""scheduler.metrics over a real AdmissionCore: queue gauges by bounded tenant and
priority labels, leases, executors, assignments and rejections."""

from meshserve.errors import ResourceExhausted
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.metrics import SchedulerMetrics
from scheduler.registry import ExecutorState


def test_scheduler_metrics_follow_the_core():
    core = AdmissionCore()
    m = SchedulerMetrics(core, max_tenants=2)
    get = m.registry.get_sample_value
    core.registry.add(ExecutorState("e0", "addr", "m", num_blocks=4, block_size=16, max_model_len=1024))
    for rid, tenant, prio in (("a", "t0", 0), ("b", "t1", 1), ("c", "t2", 1), ("d", "t0", 0)):
        core.submit(AdmissionRequest(rid, tenant, prio, 47, 16, "m"))  # 3 blocks each: one fits at a time
    assert [r.request_id for r, _ in core.dispatch()] == ["a"]
    # the first scrape sees the queue in order b (t1), c (t2), d (t0): t1 and t2 keep their names
    assert get("meshserve_scheduler_requests_waiting", {"tenant": "t1", "priority": "1"}) == 1
    assert get("meshserve_scheduler_requests_waiting", {"tenant": "t2", "priority": "1"}) == 1
    assert get("meshserve_scheduler_requests_waiting", {"tenant": "other", "priority": "0"}) == 1  # t0: over the cap
    m.on_assigned("t1", 1, 0.25)
    m.on_rejected("t3", 2, ResourceExhausted("queue full"))
    assert get("meshserve_scheduler_queue_tokens") == 3 * 47
    assert get("meshserve_scheduler_requests_running") == 1
    assert get("meshserve_scheduler_executors") == 1
    assert get("meshserve_scheduler_executor_free_blocks", {"executor_id": "e0"}) == 4  # until a capacity report
    assert get("meshserve_scheduler_queue_seconds_sum", {"tenant": "t1", "priority": "1"}) == 0.25
    assert get("meshserve_scheduler_requests_admitted_total", {"tenant": "t1", "priority": "1"}) == 1
    assert get("meshserve_scheduler_requests_rejected_total",
               {"tenant": "other", "priority": "2", "code": "resource_exhausted"}) == 1
    assert get("meshserve_scheduler_predictor_observed_total") == 0
    assert get("meshserve_scheduler_predictor_abs_error_tokens") == 0.0


def test_the_schedulers_priority_labels_keep_its_tenants_classes():
    from scheduler.config import SchedulerConfig
    from scheduler.server import SchedulerServicer
    from scheduler.tenant_limits import TenantLimits

    core = AdmissionCore(SchedulerConfig(tenant_limits={"a": TenantLimits(max_priority=3), "b": TenantLimits()}))
    assert SchedulerServicer(core).metrics.priority_label.kept == {"0", "1", "2", "3"}
