"""The lease table: the leases the scheduler holds, their lifetimes and quota charges.

The admission core (``scheduler.admission``) grants a lease when it dispatches a
request and asks the table on every release, renewal, expiry and executor report;
the table keeps each lease by id (and the request ids holding one), on its
executor's lease map, and charged to its tenant's quota (``scheduler.quotas``).

**Charges.** A lease is charged the blocks admission reserved for it until its
executor reports how many blocks the lease's requests hold
(``CapacityReport.lease_num_blocks``); from then on it is charged the reported
count (decode growth and prefix sharing included), except that a report of 0
(the request waits in the engine, or was preempted) keeps the reservation:
those blocks will be needed again.

**Lease lifetime.** A lease expires ``lease_ttl_s`` after its assignment, its
last renewal or the last report of its executor that listed it (the request
runs there: its Execute call is open), whichever is latest. The gateway renews
while no executor output reaches it (before Execute, or a request waiting in the
executor); a request that streams is kept by its executor's reports, so it costs
no renewal calls. The core's ``expire_leases`` releases each expired lease that
its executor does not list in its last report (the request is not running there:
its gateway died before Execute, or Execute ended); an expired lease its executor
still lists is kept while it is listed, since its blocks are really held. So a
dead gateway's leases come back at most ``lease_ttl_s`` + one report interval
after its last renewal or listing. An executor that drops off its Connect stream
leaves its leases detached, not void (the core's ``remove_executor``): they keep
their quota charge until released or expired, since it may still run their
requests; when it registers again and lists them, they are its own again.
"""

from __future__ import annotations

from typing import Callable, Mapping

from scheduler.quotas import TenantQuotas
from scheduler.registry import ExecutorRegistry, ExecutorState, Lease


class LeaseTable:
    """The held leases (module docstring).

    Args:
        registry: the executors, whose lease maps the table keeps in step.
        quotas: the tenants' KV quotas the leases are charged to.
        lease_ttl_s: how long a lease lives without a renewal or a listing (seconds).
        clock: the admission core's clock (seconds).
    """

    def __init__(self, registry: ExecutorRegistry, quotas: TenantQuotas, lease_ttl_s: float,
                 clock: Callable[[], float]):
        self.registry, self.quotas, self.lease_ttl_s = registry, quotas, lease_ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._request_ids: set[str] = set()  # request ids holding a lease (duplicate check)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: str) -> Lease | None:
        """A held lease, or None."""
        return self._leases.get(lease_id)

    def holds_request(self, request_id: str) -> bool:
        """Whether a held lease is ``request_id``'s."""
        return request_id in self._request_ids

    def count(self, executor_id: str) -> int:
        """Leases held on ``executor_id`` (those detached from it by a lost link included)."""
        return sum(1 for lease in self._leases.values() if lease.executor_id == executor_id)

    def grant(self, lease: Lease, executor: ExecutorState) -> None:
        """Holds a new lease on ``executor``, charging its reserved blocks to its tenant."""
        executor.leases[lease.lease_id] = lease
        self._leases[lease.lease_id] = lease
        self._request_ids.add(lease.request_id)
        self.quotas.reserve(lease.tenant, lease.num_blocks)

    def on_report(self, executor_id: str, listed: set[str], counts: Mapping[str, int]) -> None:
        """Applies the lease part of an executor's capacity report (after the registry's):
        each lease of it that it ``listed`` lives ``lease_ttl_s`` from now at least (a
        detached one is its own again), and each of its leases in ``counts`` (lease id →
        blocks held now, >= 0) is charged that count (0: its reservation). Leases of other
        executors and unknown ones are ignored."""
        expires_at = self._clock() + self.lease_ttl_s
        executor = self.registry.get(executor_id)
        for lease_id in listed:  # a listed lease is running there: the listing renews it
            lease = self._leases.get(lease_id)
            if lease is not None and lease.executor_id == executor_id:
                lease.expires_at = max(lease.expires_at, expires_at)
                if executor is not None and lease_id not in executor.leases:  # detached by a lost link: back
                    executor.leases[lease_id] = lease
                    lease.listed = lease.acked = True
        for lease_id, reported in counts.items():
            lease = self._leases.get(lease_id)
            if lease is None or lease.executor_id != executor_id:
                continue
            lease.reported_tokens = reported * executor.block_size if executor is not None else None
            charge = reported if reported > 0 else lease.reserved_blocks
            self.quotas.recharge(lease.tenant, lease.num_blocks, charge)
            lease.num_blocks = charge

    def release(self, lease_id: str) -> Lease | None:
        """Drops a lease (off its executor, its charge freed) and returns it; None when
        it is not held."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        self._request_ids.discard(lease.request_id)
        executor = self.registry.get(lease.executor_id)
        if executor is not None:
            executor.leases.pop(lease_id, None)
        self.quotas.free(lease.tenant, lease.num_blocks)
        return lease

    def renew(self, lease_id: str) -> float | None:
        """Extends a held lease by ``lease_ttl_s`` from now; returns the seconds it now
        has left, or None for a lease not held."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        lease.expires_at = self._clock() + self.lease_ttl_s
        return self.lease_ttl_s

    def expired(self) -> list[Lease]:
        """The expired leases their executors do not list (to release; module docstring)."""
        now = self._clock()
        return [lease for lease in self._leases.values() if lease.expires_at <= now and not lease.listed]
