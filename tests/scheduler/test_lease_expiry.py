"""Lease lifetime in the admission core: expiry unless renewed, reconciled with the
executor's reports (a dead gateway's leases come back), on a fake clock."""

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.registry import ExecutorState


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def setup(ttl=10.0):
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(lease_ttl_s=ttl, tenant_quotas={"acme": 4}), clock=clock)
    core.registry.add(ExecutorState("e0", "addr", "m", 64, 16, 1024))
    return core, clock


def admit(core, rid):
    core.submit(AdmissionRequest(rid, "acme", 0, 47, 16, "m"))  # 3 blocks
    ((_, lease),) = core.dispatch()
    return lease


def test_an_unrenewed_lease_its_executor_does_not_run_is_released_at_expiry():
    core, clock = setup()
    lease = admit(core, "r1")
    assert core.quotas.held("acme") == 3
    clock.t += 9.999
    assert core.expire_leases() == []
    clock.t += 0.001
    assert [lease.lease_id for lease in core.expire_leases()] == [lease.lease_id]
    assert core.num_leases() == 0 and core.quotas.held("acme") == 0
    assert core.release(lease.lease_id) is False  # the late Release of a live gateway is harmless


def test_renewal_keeps_a_lease_and_an_unknown_lease_cannot_be_renewed():
    core, clock = setup()
    lease = admit(core, "r1")
    clock.t += 8.0
    assert core.renew(lease.lease_id) == 10.0
    clock.t += 8.0
    assert core.expire_leases() == []
    clock.t += 2.0
    assert len(core.expire_leases()) == 1
    assert core.renew(lease.lease_id) is None


def test_an_expired_lease_its_executor_still_runs_is_kept_until_the_executor_drops_it():
    core, clock = setup()
    lease = admit(core, "r1")
    core.on_capacity("e0", 61, 1, 0, [lease.lease_id], {lease.lease_id: 3})
    clock.t += 60.0
    assert core.expire_leases() == []  # its blocks are really held there
    core.on_capacity("e0", 64, 0, 0, [], {})  # the request ended (its gateway's stream closed)
    assert [x.lease_id for x in core.expire_leases()] == [lease.lease_id]
    assert core.quotas.held("acme") == 0


def test_a_tenant_whose_quota_a_dead_gateway_filled_is_served_again_after_expiry():
    core, clock = setup()
    admit(core, "held-by-dead-gateway")
    core.submit(AdmissionRequest("next", "acme", 0, 47, 16, "m"))
    assert core.dispatch() == []  # 3 + 3 > quota 4: waits for its own tenant's blocks
    clock.t += 10.0
    core.expire_leases()
    ((req, _),) = core.dispatch()
    assert req.request_id == "next"


def test_a_report_that_lists_a_lease_renews_it_for_a_full_life():
    """A streaming request's gateway does not call RenewLease (``gateway.lease_renewal``):
    its executor's reports keep the lease; the life counts from the last listing."""
    core, clock = setup()
    lease = admit(core, "r1")
    clock.t += 7.0
    core.on_capacity("e0", 61, 1, 0, [lease.lease_id], {lease.lease_id: 3})  # listed at 107
    clock.t += 5.0
    core.on_capacity("e0", 64, 0, 0, [], {})  # no longer listed at 112 (its Execute ended)
    clock.t += 4.999  # 116.999: within 10 s of the last listing
    assert core.expire_leases() == []
    clock.t += 0.001
    assert [x.lease_id for x in core.expire_leases()] == [lease.lease_id]


def test_another_executors_report_does_not_renew_a_lease():
    core, clock = setup()
    core.registry.add(ExecutorState("e1", "addr1", "m", 64, 16, 1024))
    lease = admit(core, "r1")
    assert lease.executor_id == "e0"
    clock.t += 7.0
    core.on_capacity("e1", 64, 0, 0, [lease.lease_id], {})  # a report naming a lease it does not hold
    clock.t += 3.0
    assert [x.lease_id for x in core.expire_leases()] == [lease.lease_id]
