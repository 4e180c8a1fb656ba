"""Tenant KV quotas (isolation, exact block accounting) and overload control."""

import pytest

from meshserve.errors import InvalidArgument, ResourceExhausted
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.quotas import quota_max_tokens
from scheduler.registry import ExecutorState
from scheduler.wait_estimate import WaitEstimator


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def core_with(num_blocks=8, clock=None, **cfg):
    core = AdmissionCore(SchedulerConfig(**cfg), clock=clock or Clock())
    core.registry.add(ExecutorState("e0", "addr", "m", num_blocks, 16, 4096))
    return core


def req(rid, tenant="a", tokens=15, priority=0, n=1):
    return AdmissionRequest(rid, tenant, priority, tokens, 16, "m", n=n)  # 15 tokens: 1 block


def ids(assigned):
    return [r.request_id for r, _ in assigned]


def test_a_flooding_tenant_cannot_take_the_other_tenants_share():
    core = core_with(num_blocks=8, tenant_quotas={"a": 4, "b": 4})
    for i in range(40):  # tenant a: 10x its quota
        core.submit(req(f"a{i}", "a"))
    assert ids(core.dispatch()) == ["a0", "a1", "a2", "a3"]
    for i in range(4):
        core.submit(req(f"b{i}", "b"))
    # a4... wait for a's own blocks; b's requests behind them go at once
    assert ids(core.dispatch()) == ["b0", "b1", "b2", "b3"]
    assert core.quotas.snapshot() == {"a": 4, "b": 4}
    assert len(core) == 36


def placed(assigned):
    return [(r.request_id, lease.executor_id, lease.num_blocks) for r, lease in assigned]


def test_a_request_goes_where_its_quota_covers_its_blocks_capped_at_a_small_cache():
    core = AdmissionCore(SchedulerConfig(tenant_quotas={"t": 12}), clock=Clock())
    core.registry.add(ExecutorState("small", "addr", "m", 10, 16, 4096))  # 4 x 7 blocks, capped at 10
    core.registry.add(ExecutorState("big", "addr", "m", 1000, 16, 4096))  # 4 x 7 = 28 blocks > 12
    core.submit(AdmissionRequest("r1", "t", 0, 100, 10, "m", n=4))
    assert placed(core.dispatch()) == [("r1", "small", 10)]
    assert core.quotas.snapshot() == {"t": 10}
    assert len(core) == 0


def test_a_request_goes_where_its_quota_covers_its_blocks_in_a_larger_block_size():
    core = AdmissionCore(SchedulerConfig(tenant_quotas={"t": 5}), clock=Clock())
    core.registry.add(ExecutorState("bs32", "addr", "m", 100, 32, 4096))  # 101 tokens: 4 blocks
    core.registry.add(ExecutorState("bs16", "addr", "m", 1000, 16, 4096))  # 101 tokens: 7 blocks > 5
    core.submit(AdmissionRequest("r1", "t", 0, 100, 10, "m"))
    assert placed(core.dispatch()) == [("r1", "bs32", 4)]
    assert core.quotas.snapshot() == {"t": 4}


def test_a_request_its_quota_keeps_off_the_executor_with_room_is_skipped_not_a_head_of_line_block():
    core = AdmissionCore(SchedulerConfig(tenant_quotas={"t": 12}), clock=Clock())
    core.registry.add(ExecutorState("small", "addr", "m", 10, 16, 4096))
    core.registry.add(ExecutorState("big", "addr", "m", 1000, 16, 4096))
    core.registry.report("small", 0, 1, 0, set())  # full: only big has room, where r1 needs 28 blocks
    core.submit(AdmissionRequest("r1", "t", 0, 100, 10, "m", n=4))
    core.submit(AdmissionRequest("u1", "u", 0, 100, 10, "m"))  # tenant u: no quota
    assert placed(core.dispatch()) == [("u1", "big", 7)]
    assert [r.request_id for r in core.queued()] == ["r1"]
    core.registry.report("small", 10, 0, 0, set())
    assert placed(core.dispatch()) == [("r1", "small", 10)]
    assert core.quotas.snapshot() == {"t": 10, "u": 7}


def test_quota_blocked_request_waits_for_its_own_tenant_blocks():
    core = core_with(num_blocks=20, tenant_quotas={"a": 3})
    core.submit(req("a0", tokens=31))  # 2 blocks
    core.submit(req("a1", tokens=31))  # 2 more: 4 > 3, waits
    core.submit(req("x0", "x", tokens=31))  # tenant x: no quota
    got = core.dispatch()
    assert [(r.request_id, lease.num_blocks) for r, lease in got] == [("a0", 2), ("x0", 2)]
    assert core.quotas.snapshot() == {"a": 2, "x": 2}
    assert core.dispatch() == []
    core.release(got[0][1].lease_id)
    assert core.quotas.snapshot() == {"x": 2}
    assert ids(core.dispatch()) == ["a1"]
    assert core.quotas.snapshot() == {"a": 2, "x": 2}
    detached = core.remove_executor("e0")  # it may still run them: they stay charged
    assert core.quotas.snapshot() == {"a": 2, "x": 2}
    for lease in detached:
        core.release(lease.lease_id)
    assert core.quotas.snapshot() == {}


def test_a_quota_holds_across_an_executors_lost_link():
    """Found by a review: the scheduler dropped an executor whose Connect stream went
    silent and freed its leases' quota, while the executor kept running them; back
    again, it listed leases the scheduler no longer knew, and the tenant got a second
    request past its quota (6 blocks held, quota 4)."""
    clock = Clock()
    core = core_with(num_blocks=20, clock=clock, tenant_quotas={"a": 4}, lease_ttl_s=10.0)
    core.submit(req("r1", tokens=47))  # 3 blocks
    (_, lease), = core.dispatch()
    core.on_capacity("e0", 17, 1, 0, [lease.lease_id], {lease.lease_id: 3})
    core.remove_executor("e0")                                     # silent for executor_timeout_s
    core.registry.add(ExecutorState("e0", "addr", "m", 20, 16, 4096))  # registers again, r1 still running
    core.on_capacity("e0", 17, 1, 0, [lease.lease_id], {lease.lease_id: 3})
    core.submit(req("r2", tokens=47))
    assert (core.dispatch(), core.quotas.snapshot()) == ([], {"a": 3})  # r2 waits for a's own blocks
    assert list(core.registry.get("e0").leases) == [lease.lease_id]
    clock.t += 60.0                      # listed: kept past its lifetime, as any lease its executor runs
    assert core.expire_leases() == []
    core.release(lease.lease_id)
    assert ids(core.dispatch()) == ["r2"]


def test_a_detached_lease_no_executor_lists_expires_and_frees_its_quota():
    clock = Clock()
    core = core_with(num_blocks=20, clock=clock, tenant_quotas={"a": 4}, lease_ttl_s=10.0)
    core.submit(req("r1", tokens=47))
    (_, lease), = core.dispatch()
    core.on_capacity("e0", 17, 1, 0, [lease.lease_id], {lease.lease_id: 3})
    core.remove_executor("e0")           # gone for good: its gateway died too, nobody releases
    clock.t += 9.9
    assert (core.expire_leases(), core.quotas.snapshot()) == ([], {"a": 3})
    clock.t += 0.2
    assert [x.lease_id for x in core.expire_leases()] == [lease.lease_id]
    assert (core.num_leases(), core.quotas.snapshot()) == (0, {})


def test_request_alone_over_its_quota_is_resource_exhausted():
    core = core_with(num_blocks=20, tenant_quotas={"a": 4}, retry_after_s=2.5)
    with pytest.raises(ResourceExhausted) as info:
        core.submit(req("big", tokens=79))  # ceil(80 / 16) = 5
    assert str(info.value) == ("request needs 5 KV blocks (a prompt of 79 tokens + 1, in blocks of 16); tenant 'a' "
                               "has a quota of 4 blocks")
    assert info.value.retry_after_s is None  # it never fits: no retry delay
    with pytest.raises(ResourceExhausted) as info:
        core.submit(req("n3", tokens=31, n=3))
    assert str(info.value) == ("request needs 6 KV blocks (3 choices of a prompt of 31 tokens + 1, in blocks of 16); "
                               "tenant 'a' has a quota of 4 blocks")
    small = core_with(num_blocks=4, tenant_quotas={"a": 3})  # n × blocks capped at the executor's cache
    with pytest.raises(ResourceExhausted) as info:
        small.submit(req("n3", tokens=31, n=3))
    assert str(info.value) == ("request needs 4 KV blocks (3 choices of a prompt of 31 tokens + 1, in blocks of 16, "
                               "at most the executor's 4); tenant 'a' has a quota of 3 blocks")
    core.submit(req("ok", tokens=63))  # 4 blocks: exactly the quota
    assert ids(core.dispatch()) == ["ok"]


def test_count_bound_displaces_lower_priority_latest_first():
    core = core_with(num_blocks=1, max_queue_len=3)
    core.registry.report("e0", 0, 0, 0, set())  # nothing dispatches
    for rid in ("x1", "x2", "x3"):
        assert core.submit(req(rid)) == []
    with pytest.raises(ResourceExhausted, match="queue is full"):
        core.submit(req("x4"))
    assert [v.request_id for v in core.submit(req("hi", priority=1))] == ["x3"]
    assert [v.request_id for v in core.submit(req("hi2", priority=1))] == ["x2"]
    with pytest.raises(ResourceExhausted):
        core.submit(req("eq", priority=0))  # nothing of lower priority than 0 to displace
    assert sorted(r.request_id for r in core.queued()) == ["hi", "hi2", "x1"]


def test_token_bound_displaces_until_it_fits_or_rejects_without_displacing():
    core = core_with(num_blocks=100, max_queue_tokens=100)
    core.registry.report("e0", 0, 0, 0, set())
    core.submit(req("p60", tokens=60))
    core.submit(req("p30", tokens=30))
    with pytest.raises(ResourceExhausted):
        core.submit(req("p20", tokens=20))  # 110 > 100
    displaced = core.submit(req("hi", tokens=50, priority=1))  # 140 -> drop p30 (110) -> drop p60 (50)
    assert [v.request_id for v in displaced] == ["p30", "p60"]
    assert [r.request_id for r in core.queued()] == ["hi"]
    core.submit(req("p40", tokens=40))  # 90
    with pytest.raises(ResourceExhausted):
        core.submit(req("hi80", tokens=80, priority=1))  # without p40 still 130 > 100: refused
    assert [r.request_id for r in core.queued()] == ["hi", "p40"]  # a refused arrival displaces nobody


def test_empty_queue_takes_one_request_over_the_token_bound():
    core = core_with(num_blocks=100, max_queue_tokens=100)
    core.registry.report("e0", 0, 0, 0, set())
    core.submit(req("huge", tokens=500))
    assert len(core) == 1


def test_wait_estimate_uses_service_rate_then_dispatch_gaps():
    w = WaitEstimator()
    assert w.estimate(1000, 3) == 0.0
    w.on_dispatch(0.0)
    w.on_dispatch(2.0)
    assert w.estimate(1000, 3) == 8.0  # (3 + 1) * 2 s
    w.on_release(0.0, 100)
    w.on_release(2.0, 300)
    w.on_release(4.0, 100)
    assert w.service_rate() == 100.0  # (300 + 100) tokens / 4 s
    assert w.estimate(250, 3) == 2.5


def test_release_teaches_predictor_and_wait_estimate_uses_it():
    clock = Clock()
    core = core_with(num_blocks=8, clock=clock, retry_after_s=0.5)
    core.submit(req("a0"))  # prior: 16 // 2 = 8 tokens predicted
    (_, lease), = core.dispatch()
    clock.t += 1.0
    core.release(lease.lease_id, num_completion_tokens=12)
    assert core.predictor.stats() == {"num_observed": 1, "num_scored": 1, "mean_abs_error_tokens": 4.0}
    core.submit(req("a1"))
    (_, lease), = core.dispatch()
    clock.t += 1.0
    core.release(lease.lease_id, num_completion_tokens=4)
    assert core.waits.service_rate() == 19.0  # (15 + 4) tokens in 1 s
    core.registry.report("e0", 0, 0, 0, set())
    core.submit(req("q0", tokens=23))  # predicted 8 (prior: < 3 samples): cost 31
    core.submit(req("q1", tokens=42))  # cost 50
    assert core.estimated_wait_s(1) == pytest.approx(81 / 19)
    assert core.retry_delay_s() == pytest.approx(81 / 19)


def test_executor_reports_correct_the_tenant_charge():
    core = core_with(num_blocks=64, tenant_quotas={"a": 10})
    for i in range(3):
        core.submit(req(f"a{i}", "a"))           # 1 block each (admission reservation)
    leases = [lease for _, lease in core.dispatch()]
    assert core.quotas.snapshot() == {"a": 3}
    l0, l1, l2 = (lease.lease_id for lease in leases)
    # decode growth: a0 now holds 6 blocks, a1 2; a2 waits in the engine (0: keeps its reservation)
    core.on_capacity("e0", 55, 2, 1, [l0, l1, l2], {l0: 6, l1: 2, l2: 0})
    assert core.quotas.snapshot() == {"a": 9}
    assert [lease.num_blocks for lease in leases] == [6, 2, 1]
    core.submit(req("a3", "a", tokens=31))       # 2 blocks: 9 + 2 > 10, waits for a's own blocks
    assert core.dispatch() == []
    core.on_capacity("e0", 57, 2, 0, [l0, l1, l2], {l0: 4, l1: 2, l2: 1})
    assert core.quotas.snapshot() == {"a": 7}
    assert ids(core.dispatch()) == ["a3"]
    assert core.quotas.snapshot() == {"a": 9}
    core.release(l0)                              # frees the corrected 4, not the reserved 1
    assert core.quotas.snapshot() == {"a": 5}
    core.on_capacity("e0", 57, 2, 0, [], {"unknown": 3, l1: 2})
    assert core.quotas.snapshot() == {"a": 5}
    with pytest.raises(InvalidArgument, match="lease_num_blocks must be >= 0"):
        core.on_capacity("e0", 57, 2, 0, [], {l1: -1})


@pytest.mark.parametrize("quota, n, prompt, expected", [
    (None, 1, 12, 0),       # no quota: no bound
    (2, 1, 12, 20),         # 2 blocks of 16: 32 tokens, 12 of them the prompt
    (2, 2, 12, 4),          # two choices: one block each
    (3, 2, 12, 4),          # the odd block is no choice's
    (8, 1, 100, 28),
    (1, 1, 15, 1),          # the smallest request admission takes: ceil((15 + 1) / 16) = 1 block
])
def test_a_quota_bounds_the_tokens_each_choice_may_generate(quota, n, prompt, expected):
    assert quota_max_tokens(quota, n, 16, prompt) == expected

