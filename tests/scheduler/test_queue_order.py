"""Queue positions and estimated waits from the cached order (scheduler.queue_order)
equal those of a fresh sort for every request of a random queue."""

import random

import pytest

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.queue_order import ORDER_MAX_AGE_S, QueueOrder
from scheduler.queue_policy import QueuePolicy
from scheduler.registry import ExecutorState


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def fresh_positions(core):
    """The computation the cache replaced: a sort now for each answer."""
    return {r.request_id: i for i, r in enumerate(core.queued())}


def fresh_wait(core, position):
    ahead = core.queued()[: max(0, position) + 1]
    return core.waits.estimate(sum(r.cost for r in ahead), position)


def random_walk(policy, seed, steps, min_step_s):
    """A core whose queue is changed at random; yields it after each change (and clock step)."""
    rng = random.Random(seed)
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(queue_policy=policy, max_queue_wait_s=5.0), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 4096))
    core.registry.report("e0", 0, 0, 0, set())
    leases = []
    for step in range(steps):
        clock.t += min_step_s + rng.random() * 0.3
        op = rng.random()
        if op < 0.55:
            core.submit(AdmissionRequest(f"r{step}", rng.choice("ab"), rng.randint(0, 2),
                                         rng.randint(1, 200), rng.randint(1, 300), "m", n=rng.randint(1, 3)))
        elif op < 0.7 and len(core):
            core.cancel(rng.choice(core.queued()).request_id)
        elif op < 0.85:
            core.registry.report("e0", rng.randint(0, 40), 0, 0, {lease.lease_id for lease in leases})
            leases += [lease for _, lease in core.dispatch()]
            core.registry.report("e0", 0, 0, 0, {lease.lease_id for lease in leases})
        elif leases:
            lease = leases.pop(rng.randrange(len(leases)))
            core.release(lease.lease_id, num_completion_tokens=rng.randint(1, 300))
        yield core


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cached_positions_and_waits_equal_a_fresh_sort_on_a_random_queue(policy, seed):
    # sjf: the clock moves on by at least the snapshot's largest age between checks, so each check
    # reads a snapshot taken at that time; fcfs and priority: any step.
    min_step_s = ORDER_MAX_AGE_S if policy == "sjf" else 0.0
    checked = 0
    for core in random_walk(policy, seed, steps=300, min_step_s=min_step_s):
        expected = fresh_positions(core)
        ids = list(expected)
        random.Random(len(ids)).shuffle(ids)  # asked in any order, as the waiters poll
        assert {rid: core.position(rid) for rid in ids} == expected
        assert core.position("not-queued") == -1
        for position in range(-1, len(expected) + 2):
            assert core.estimated_wait_s(position) == fresh_wait(core, position)
        assert core.retry_delay_s() == max(core.config.retry_after_s, fresh_wait(core, len(core) - 1))
        checked += len(ids)
    assert checked > 1000  # the walk kept a real queue
    assert core.waits.service_rate() is not None  # and the waits came from a measured rate


def test_fcfs_positions_need_one_sort_per_queue_change(monkeypatch):
    sorts = []
    original = QueuePolicy.order
    monkeypatch.setattr(QueuePolicy, "order", lambda self, q, now: sorts.append(now) or original(self, q, now))
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 4096))
    core.registry.report("e0", 0, 0, 0, set())
    for i in range(50):
        core.submit(AdmissionRequest(f"r{i}", "t", 0, 10 + i, 16, "m"))
    for _ in range(3):  # three polling rounds of all 50 waiters, the clock moving on
        for i in range(50):
            clock.t += 0.01
            assert core.position(f"r{i}") == i
            assert core.estimated_wait_s(i) == 0.0  # nothing dispatched yet: unknown
    assert sorts == [100.01]
    core.cancel("r0")
    assert [core.position(f"r{i}") for i in (1, 49)] == [0, 48]
    assert sorts == [100.01, clock.t]  # 150 polls later


def test_sjf_positions_are_those_of_an_order_at_most_the_largest_age_old():
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(queue_policy="sjf", max_queue_wait_s=10.0), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 1000, 16, 4096))
    core.registry.report("e0", 0, 0, 0, set())
    core.submit(AdmissionRequest("long", "t", 0, 950, 100, "m"))  # cost 950 + 50 = 1000, queued at 100 s
    clock.t = 108.5
    core.submit(AdmissionRequest("short", "t", 0, 50, 100, "m"))  # cost 50 + 50 = 100
    # effective costs: long 1000 * (1 - (t - 100) / 10), short 100 * (1 - (t - 108.5) / 10): equal at t = 109.06
    clock.t = 109.0  # long 100, short 95
    assert [core.position("long"), core.position("short")] == [1, 0]
    clock.t = 109.3  # long 70, short 92: a fresh sort puts long first, the 0.3 s old snapshot does not
    assert fresh_positions(core) == {"long": 0, "short": 1}
    assert [core.position("long"), core.position("short")] == [1, 0]
    clock.t = 109.0 + ORDER_MAX_AGE_S  # the snapshot is the largest age old: sorted again
    assert [core.position("long"), core.position("short")] == [0, 1]
    clock.t = 109.6
    core.submit(AdmissionRequest("tiny", "t", 0, 1, 100, "m"))  # a queue change: sorted again at once
    assert [core.position(r) for r in ("long", "tiny", "short")] == [0, 1, 2]  # 40, 51, 89
    clock.t = 109.0  # the clock went back: sorted again (long 100, tiny 51, short 95)
    assert [core.position(r) for r in ("tiny", "short", "long")] == [0, 1, 2]
    assert ORDER_MAX_AGE_S == 0.5


def test_order_rejects_a_negative_largest_age():
    with pytest.raises(ValueError, match="max_age_s must be >= 0 seconds, got -1"):
        QueueOrder(QueuePolicy("sjf"), max_age_s=-1)


def test_a_waits_cost_asked_again_at_dispatch_is_counted_in_the_estimated_wait():
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(predictor_min_samples=1), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 4096))
    core.submit(AdmissionRequest("a", "t", 0, 15, 500, "m"))
    core.submit(AdmissionRequest("b", "t", 0, 15, 500, "m"))
    (_, first), (_, second) = core.dispatch()
    core.registry.report("e0", 0, 2, 0, {first.lease_id, second.lease_id})
    core.submit(AdmissionRequest("x", "t", 0, 15, 500, "m"))  # the predictor knows nothing yet: the prior
    prior_cost = core.queued()[0].cost
    assert core.position("x") == 0
    clock.t = 101.0
    core.release(first.lease_id, num_completion_tokens=85)
    clock.t = 102.0
    core.release(second.lease_id, num_completion_tokens=85)  # 100 tokens in 1 s
    assert core.dispatch() == []  # no room; x's cost is asked again: 15 + the learned 85
    assert (prior_cost, core.queued()[0].cost) == (265, 100)  # 15 + the prior 250, then 15 + 85
    assert core.estimated_wait_s(0) == fresh_wait(core, 0) == 1.0
