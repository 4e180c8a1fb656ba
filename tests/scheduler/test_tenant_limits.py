"""Tenant isolation at admission: known tenants only, the priority ceiling, rate limits
(``scheduler.tenant_limits``), on a fake clock."""

import pytest

from meshserve.errors import PermissionDenied, ResourceExhausted
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.registry import ExecutorState
from scheduler.tenant_limits import TenantLimits, TokenBucket


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def core_with(limits, clock=None, **config):
    core = AdmissionCore(SchedulerConfig(tenant_limits=limits, **config), clock=clock or Clock())
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 1024))
    return core


def req(rid, tenant, priority=0, tokens=15, max_tokens=16):
    return AdmissionRequest(rid, tenant, priority, tokens, max_tokens, "m")


def test_a_tenant_the_tenants_file_does_not_list_is_not_admitted():
    core = core_with({"acme": TenantLimits()})
    with pytest.raises(PermissionDenied, match="unknown tenant 'forged'"):
        core.submit(req("r", "forged"))
    assert len(core) == 0
    core.submit(req("r", "acme"))
    assert [r.request_id for r in core.queued()] == ["r"]


def test_priority_above_the_ceiling_is_clamped_for_queue_order_and_displacement():
    clock = Clock()
    core = core_with({"low": TenantLimits(max_priority=1), "other": TenantLimits()}, clock,
                     queue_policy="priority", max_queue_len=1, max_engine_waiting=None)
    core.registry.get("e0").num_free_blocks = 0  # nothing dispatches: the queue holds
    core.submit(req("victim", "other", priority=1))
    # asks for 2**31 - 1; clamped to 1: not above the queued priority-1 request, so it cannot displace it
    with pytest.raises(ResourceExhausted, match="queue is full"):
        core.submit(req("greedy", "low", priority=2**31 - 1))
    assert [r.request_id for r in core.queued()] == ["victim"]
    core.cancel("victim")
    greedy = req("greedy", "low", priority=2**31 - 1)
    core.submit(greedy)
    assert greedy.priority == 1


def test_tenant_over_its_request_rate_gets_the_refill_time_while_the_other_is_unaffected():
    clock = Clock()
    core = core_with({"a": TenantLimits(requests_per_s=2.0), "b": TenantLimits()}, clock)
    core.submit(req("a1", "a"))
    core.submit(req("a2", "a"))  # burst of one second: 2 requests
    with pytest.raises(ResourceExhausted, match="2 requests/s") as err:
        core.submit(req("a3", "a"))
    assert err.value.retry_after_s == pytest.approx(0.5)
    for i in range(10):
        core.submit(req(f"b{i}", "b"))  # tenant b: no limit, unaffected
    clock.t += 0.5
    core.submit(req("a3", "a"))
    assert len(core) == 13


def test_tokens_per_minute_charge_the_prompt_at_admission_and_the_completion_at_release():
    clock = Clock()
    core = core_with({"a": TenantLimits(tokens_per_min=600.0), "b": TenantLimits(tokens_per_min=600.0)}, clock)
    core.submit(req("a1", "a", tokens=100))
    ((_, lease),) = core.dispatch()
    core.release(lease.lease_id, num_completion_tokens=480)  # 600 - 100 - 480 = 20 tokens left
    with pytest.raises(ResourceExhausted, match="600 tokens/min") as err:
        core.submit(req("a2", "a", tokens=50))
    assert err.value.retry_after_s == pytest.approx(3.0)  # 30 tokens at 10 tokens/s
    core.submit(req("b1", "b", tokens=500))  # b's bucket is its own
    clock.t += 3.0
    core.submit(req("a2", "a", tokens=50))


def test_tokens_generated_before_the_caller_left_are_charged_but_teach_no_prediction():
    clock = Clock()
    core = core_with({"a": TenantLimits(tokens_per_min=600.0)}, clock)
    core.submit(req("a1", "a", tokens=100))
    ((_, lease),) = core.dispatch()
    core.release(lease.lease_id, num_generated_tokens=480)  # left mid-stream: 600 - 100 - 480 = 20 left
    with pytest.raises(ResourceExhausted, match="600 tokens/min") as err:
        core.submit(req("a2", "a", tokens=50))
    assert err.value.retry_after_s == pytest.approx(3.0)
    assert core.predictor.stats()["num_observed"] == 0  # a cut-short output length is no sample


def test_token_bucket_refills_to_capacity_and_may_go_into_debt():
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=0.0)
    bucket.take(150, now=0.0)
    assert bucket.level == -50.0
    assert bucket.wait_s(10, now=0.0) == pytest.approx(6.0)
    assert bucket.wait_s(1_000, now=100.0) == 0.0  # more than the capacity: a full bucket admits it
    assert bucket.level == 100.0


def test_token_bucket_keeps_its_level_when_the_clock_steps_back():
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=50.0)
    bucket.take(40, now=50.0)
    assert bucket.wait_s(10, now=45.0) == 0.0  # 5 s back: nothing refilled, nothing drained
    assert bucket.level == 60.0
    assert bucket.wait_s(100, now=51.0) == pytest.approx(3.0)  # refills from 50 s, the latest time seen
    assert bucket.level == 70.0


def test_without_configured_limits_any_tenant_is_admitted():
    core = AdmissionCore()
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 1024))
    core.submit(req("r", "anyone", priority=2**31 - 1))
    assert core.queued()[0].priority == 2**31 - 1


def test_scheduler_config_admits_the_tenants_of_the_file_or_default_alone(tmp_path):
    from meshserve.cli.processes import scheduler_config

    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["k"]\nmax_priority = 2\nrequests_per_s = 5\n'
                    'tokens_per_min = 600\n\n[[tenants]]\nname = "globex"\napi_keys = ["g"]\n')
    assert scheduler_config(tenants_file=str(path)).tenant_limits == {
        "acme": TenantLimits(2, 5.0, 600.0), "globex": TenantLimits()}
    assert scheduler_config().tenant_limits == {"default": TenantLimits()}


def test_scheduler_config_reads_a_file_holding_the_gateways_task_bound(tmp_path):
    """``max_unfinished_tasks`` is the gateways' field; the scheduler reads the same file
    and starts with it, its own limits unchanged."""
    from meshserve.cli.processes import scheduler_config

    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["k"]\nmax_unfinished_tasks = 4\nrequests_per_s = 5\n')
    config = scheduler_config(tenants_file=str(path))
    assert config.tenant_limits == {"acme": TenantLimits(None, 5.0, None)}


@pytest.mark.parametrize("line, message", [
    ("max_priority = 1.5", "'max_priority' must be an integer, got 1.5"),
    ("requests_per_s = 0", "'requests_per_s' must be a number > 0, got 0"),
    ("tokens_per_min = true", "'tokens_per_min' must be a number > 0, got True"),
])
def test_tenants_file_rejects_bad_limits(tmp_path, line, message):
    from gateway.tenants import TenantRegistry

    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenants]]\nname = "acme"\napi_keys = ["k"]\n{line}\n')
    with pytest.raises(ValueError) as info:
        TenantRegistry.from_file(path)
    assert str(info.value).endswith(message)
