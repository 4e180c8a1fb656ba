"""Queue policies: exact orders for fcfs, priority and sjf with aging (case C23: no starvation)."""

from dataclasses import dataclass

import pytest

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.queue_policy import QueuePolicy
from scheduler.registry import ExecutorState


@dataclass
class Item:
    name: str
    priority: int
    arrival: float
    seq: int
    cost: float


# A: old and long, B: short, C: middling and young, D: urgent and huge.
ITEMS = [Item("A", 0, 0.0, 0, 1000), Item("B", 0, 5.0, 1, 100), Item("C", 0, 9.0, 2, 600), Item("D", 1, 9.0, 3, 5000)]


def names(policy, now):
    return "".join(i.name for i in policy.order(ITEMS, now))


def test_fcfs_is_arrival_order_whatever_priority_or_cost():
    assert names(QueuePolicy("fcfs"), 9.0) == "ABCD"


def test_priority_is_class_then_arrival():
    assert names(QueuePolicy("priority"), 9.0) == "DABC"


def test_sjf_ages_the_cost_linearly_to_zero_at_the_bound():
    sjf = QueuePolicy("sjf", max_queue_wait_s=10.0)
    # now 9: A 1000*0.1 = 100, B 100*0.6 = 60, C 600*1.0 = 600
    assert [sjf.effective_cost(i, 9.0) for i in ITEMS[:3]] == pytest.approx([100.0, 60.0, 600.0])
    assert names(sjf, 9.0) == "DBAC"
    # now 9.5: A 50, B 55, C 570: A passes B
    assert names(sjf, 9.5) == "DABC"
    # now 20: A, B and C are overdue (effective cost 0): arrival order; D's class stays first
    assert [sjf.effective_cost(i, 20.0) for i in ITEMS[:3]] == [0.0, 0.0, 0.0]
    assert names(sjf, 20.0) == "DABC"


def test_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown queue policy"):
        QueuePolicy("lifo")
    with pytest.raises(ValueError, match="> 0"):
        QueuePolicy("sjf", max_queue_wait_s=0)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_long_request_among_a_stream_of_short_ones_is_served_within_the_bound():
    """Case C23 on the bare core: one executor with room for one request at a time; a short request
    arrives every second."""
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(queue_policy="sjf", max_queue_wait_s=10.0), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 1, 2048, 4096))
    core.submit(AdmissionRequest("s0", "t", 0, 10, 16, "m"))
    (_, lease), = core.dispatch()
    core.submit(AdmissionRequest("long", "t", 0, 2000, 16, "m"))  # cost 2000 + 8, shorts 10 + 8
    served = []
    for i in range(1, 30):
        clock.t += 1.0
        core.submit(AdmissionRequest(f"s{i}", "t", 0, 10, 16, "m"))
        core.release(lease.lease_id)
        (req, lease), = core.dispatch()
        served.append((req.request_id, clock.t - req.arrival))
    long_at = [rid for rid, _ in served].index("long")
    # The long request's effective cost 2008*(1 - w/10) drops under a fresh short's 18 only at w > 9.91 s:
    # it is served at w = 10 s (with the SJF order alone it would wait for ever).
    assert served[long_at] == ("long", 10.0)
    assert [rid for rid, _ in served[:long_at]] == [f"s{i}" for i in range(1, 10)]
    assert max(w for _, w in served) == 10.0


def test_admission_positions_follow_the_policy():
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(queue_policy="sjf", max_queue_wait_s=10.0), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 1000, 16, 4096))
    core.registry.report("e0", 0, 0, 0, set())  # nothing free: everything queues
    core.submit(AdmissionRequest("big", "t", 0, 500, 100, "m"))    # cost 500 + 50
    core.submit(AdmissionRequest("small", "t", 0, 10, 100, "m"))   # cost 10 + 50
    core.submit(AdmissionRequest("urgent", "t", 5, 900, 100, "m"))  # higher class
    assert [r.request_id for r in core.queued()] == ["urgent", "small", "big"]
    assert [core.position(r) for r in ("urgent", "small", "big", "nope")] == [0, 1, 2, -1]
    assert [r.cost for r in core.queued()] == [950, 60, 550]
