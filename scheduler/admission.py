"""The scheduler's pure core: the admission queue and dispatch to executors.

No gRPC here: the servicer calls ``submit``, ``dispatch``, ``release`` and the
registry methods, and turns the results into stream events. The core decides
and keeps the parts in step; the queue (``scheduler.admission_queue``), the
lease table (``scheduler.lease_table``), the settings (``scheduler.config``),
the checks that refuse a request outright (``scheduler.admission_checks``) and
the policies live in their own modules.

**Order.** ``dispatch`` walks the queue in the order of its ``QueuePolicy``
(``scheduler.queue_policy``: fcfs, priority classes, or shortest-job-first on
predicted cost with aging). Each request goes where ``scheduler.placement``
says (its pool or an idle spill target, an executor with room within its
tenant's quota, the cheapest by the routing cost of ``scheduler.routing``); if
no executor has room for it, the walk skips every later request of the same
model and pool (pool None without a pools file), so a large request at the
head is never starved by smaller ones behind it, and a saturated pool or model
does not hold up another.

**Tenant quotas** (``scheduler.quotas``). A request whose tenant would exceed its
``kv_quota_blocks`` with it is *skipped*, not stopped at: it waits until its own
tenant's leases end, and requests of other tenants behind it go on. Its blocks
differ between executors (block size, the cap at a whole cache), so it goes only
to an executor where its quota covers them; when only executors it needs too
many blocks on have room, it is skipped the same way. A request
that alone needs more blocks than its tenant's quota is refused at once
(RESOURCE_EXHAUSTED with no retry delay: waiting never makes it fit). A lease is
charged the blocks admission reserved for it until its executor reports how many
its requests hold (``scheduler.lease_table``).

**Overload** (``scheduler.admission_queue``). The queue holds at most
``max_queue_len`` requests and ``max_queue_tokens`` queued prompt tokens; an
arrival that does not fit displaces queued requests of strictly lower priority,
or is refused. Displaced and refused requests get RESOURCE_EXHAUSTED with a
retry delay: the estimated wait of the queue's tail (at least ``retry_after_s``
when nothing is measured yet).

**Tenants** (``scheduler.tenant_limits``). With ``tenant_limits`` set, only the
tenants it lists are admitted (PERMISSION_DENIED otherwise), a request's
priority is clamped to its tenant's ``max_priority``, and its tenant's rate
limits apply (RESOURCE_EXHAUSTED with the bucket's refill time as the delay).

**Scale to zero**. With ``start_budget_s`` set, a request whose
model no executor serves is queued instead of refused: it waits for an executor
to start and register (the planner counts it as queued load, so one is asked
for). ``expire_start_waits`` ends each request that has found no executor of its
model for ``start_budget_s`` (UNAVAILABLE: the executor did not start in time),
and each that the executors which came cannot hold (INVALID_ARGUMENT).

**Leases** (``scheduler.lease_table``). A lease expires ``lease_ttl_s`` after
its assignment, its last ``renew`` or the last report of its executor that
listed it, whichever is latest; ``expire_leases`` releases each expired lease
that its executor does not list. An executor that drops off its Connect stream
leaves its leases detached, not void (``remove_executor``).
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Callable, Iterable, Mapping

from meshserve.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from scheduler.admission_checks import check_fits, check_quota_alone, describe, tenant_limits
from scheduler.admission_queue import AdmissionQueue, AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.kvstore_index import KVStoreIndex
from scheduler.lease_table import LeaseTable
from scheduler.placement import Placer, blocks_needed, fits_ever
from scheduler.predictor import OutputLengthPredictor
from scheduler.prefix_index import PrefixIndex
from scheduler.queue_policy import QueuePolicy
from scheduler.quotas import TenantQuotas
from scheduler.registry import ExecutorRegistry, Lease
from scheduler.tenant_limits import RateLimiter
from scheduler.wait_estimate import WaitEstimator


class AdmissionCore:
    """Admission queue, quotas and dispatch over an ``ExecutorRegistry``."""

    def __init__(self, config: SchedulerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or SchedulerConfig()
        self.policy = QueuePolicy(self.config.queue_policy, self.config.max_queue_wait_s)
        self._queue = AdmissionQueue(self.policy, self.config.max_queue_len, self.config.max_queue_tokens)
        self.registry = ExecutorRegistry()
        self.prefix_index = PrefixIndex()
        self.kvstore_index = KVStoreIndex()  # filled by scheduler.kvstore_follower (--kvstore)
        self.placer = Placer(self.registry, self.prefix_index, self.config.pools, self.config.routing,
                             self.config.pending_timeout_s, self.config.max_engine_waiting,
                             self.config.kv_reservation, self.kvstore_index)
        self.predictor = OutputLengthPredictor(self.config.predictor_min_samples)
        self.quotas = TenantQuotas(self.config.tenant_quotas)
        self.waits = WaitEstimator()
        self.rates = RateLimiter(dict(self.config.tenant_limits or {}))
        self._clock = clock
        self.lease_table = LeaseTable(self.registry, self.quotas, self.config.lease_ttl_s, clock)

    # -- queue -----------------------------------------------------------------
    def servable(self, req: AdmissionRequest) -> bool:
        """Whether any executor of its model is in a pool it may use."""
        return bool(self.placer.executors_for(req))

    def submit(self, req: AdmissionRequest) -> list[AdmissionRequest]:
        """Queues a request; returns the lower-priority requests it displaced.

        Raises:
            Unavailable: no executor serves its model (and no ``start_budget_s``).
            InvalidArgument: no executor could ever hold it (prompt longer than
                max_model_len or than a whole KV cache).
            ResourceExhausted: the queue is full (count or tokens) and nothing of
                lower priority can make room, or the request alone needs more
                blocks than its tenant's quota.
            AlreadyExists: a request with the same id is queued or holds a lease, or
                its ``lease_id`` is already a lease's or a queued request's.
            PermissionDenied: a tenant the configured tenants do not list.
        """
        limits = tenant_limits(self.config.tenant_limits, req.tenant)
        req.priority = limits.clamp_priority(req.priority)
        if req.request_id in self._queue or self.lease_table.holds_request(req.request_id):
            raise AlreadyExists(f"request_id {req.request_id!r} is already queued or running")
        if req.lease_id and self.lease_id_in_use(req.lease_id):
            raise AlreadyExists(f"lease_id {req.lease_id!r} is already in use")
        executors = self.placer.executors_for(req)
        if not executors and self.config.start_budget_s is None:
            raise Unavailable(f"no executor is serving {describe(req, self.config.pools)}")
        if executors:
            check_fits(req, executors)
        else:
            req.no_executor_since = self._clock()  # scale to zero: waits for one to start
        check_quota_alone(req, [e for e in executors if fits_ever(e, req)], self.quotas.limit(req.tenant))
        self.rates.check(req.tenant, req.num_prompt_tokens * max(1, req.n), self._clock())
        displaced = self._make_room(req)
        self.rates.admit(req.tenant, req.num_prompt_tokens * max(1, req.n), self._clock())
        self._predict(req)
        req.arrival = req.arrival or self._clock()
        self._queue.add(req)
        return displaced

    def lease_id_in_use(self, lease_id: str) -> bool:
        """Whether ``lease_id`` is a lease's, a queued request's proposed one, or one an
        executor still lists (a released lease whose run has not ended there yet)."""
        return (lease_id in self.lease_table or self._queue.has_lease_id(lease_id)
                or any(lease_id in e.listed_lease_ids for e in self.registry))

    def expire_start_waits(self) -> list[tuple[AdmissionRequest, Exception]]:
        """Scale to zero (module docstring): removes each queued request that has found
        no executor of its model for ``start_budget_s`` (with Unavailable) or that the
        executors of its model cannot hold (InvalidArgument; ResourceExhausted: more
        blocks than its tenant's quota); returns them with the error."""
        budget, now = self.config.start_budget_s, self._clock()
        out: list[tuple[AdmissionRequest, Exception]] = []
        for req in list(self._queue):
            executors = self.placer.executors_for(req)
            if executors:
                req.no_executor_since = None
                try:
                    check_fits(req, executors)
                    check_quota_alone(req, [e for e in executors if fits_ever(e, req)], self.quotas.limit(req.tenant))
                except (InvalidArgument, ResourceExhausted) as exc:
                    out.append((req, exc))
                continue
            if req.no_executor_since is None:
                req.no_executor_since = now  # its executors left: it waits for new ones
            if budget is not None and now - req.no_executor_since >= budget:
                what = describe(req, self.config.pools)
                out.append((req, Unavailable(
                    f"no executor of {what} was ready within the start budget of {budget:g} s")))
        for req, _ in out:
            self._queue.remove(req.request_id)
        return out

    def _predict(self, req: AdmissionRequest) -> None:
        prediction = self.predictor.predict(req.tenant, req.num_prompt_tokens, req.max_tokens)
        req.predicted_output_tokens = prediction.tokens
        req.prediction_level = prediction.level
        cost = req.num_prompt_tokens + max(1, req.n) * prediction.tokens
        if cost != req.cost:
            req.cost = cost
            self._queue.changed()  # the sjf order and the estimated waits change

    def _make_room(self, req: AdmissionRequest) -> list[AdmissionRequest]:
        """Displaces lower-priority requests so ``req`` fits the bounds, or raises."""
        victims = self._queue.victims_for(req)
        if victims is None:
            raise ResourceExhausted(
                f"admission queue is full ({len(self._queue)} requests, {self._queue.tokens} prompt tokens; "
                f"bounds {self.config.max_queue_len} requests, {self.config.max_queue_tokens} tokens)",
                self.retry_delay_s(),
            )
        for victim in victims:
            self._queue.remove(victim.request_id)
        return victims

    def retry_delay_s(self) -> float:
        """Suggested retry delay: the estimated wait of the queue's tail, at least ``retry_after_s``."""
        return max(self.config.retry_after_s, self.estimated_wait_s(len(self._queue) - 1))

    def cancel(self, request_id: str) -> bool:
        """Removes a queued request (its caller went away)."""
        return self._queue.remove(request_id) is not None

    def withdraw(self, lease_id: str) -> AdmissionRequest | None:
        """Removes and returns the queued request that proposed ``lease_id``, or None: its
        caller released the lease before it was granted (a Release can reach the scheduler
        before the caller's cancelled Admit does; granted then, the lease would wait for
        its expiry)."""
        return self._queue.withdraw(lease_id)

    def queued(self) -> list[AdmissionRequest]:
        """Queued requests in dispatch order now."""
        return self._queue.ordered(self._clock())

    def position(self, request_id: str) -> int:
        """0-based position in dispatch order now (sjf: at most ``ORDER_MAX_AGE_S`` ago,
        ``scheduler.queue_order``), or -1 if not queued."""
        if request_id not in self._queue:
            return -1
        return self._queue.snapshot(self._clock()).index[request_id]

    def estimated_wait_s(self, position: int) -> float:
        """Wait of the request at ``position`` (``scheduler.wait_estimate``; the order as
        ``position`` reads it), in seconds; 0 when unknown."""
        snap = self._queue.snapshot(self._clock())
        return self.waits.estimate(snap.cost_upto[min(len(snap.order), max(0, position) + 1)], position)

    def __len__(self) -> int:
        return len(self._queue)

    # -- dispatch --------------------------------------------------------------
    def _quota_blocked(self, req: AdmissionRequest) -> bool:
        fitting = [e for e in self.placer.executors_for(req) if fits_ever(e, req)]
        return bool(fitting) and not self.quotas.allows(req.tenant, min(blocks_needed(e, req) for e in fitting))

    def dispatch(self) -> list[tuple[AdmissionRequest, Lease]]:
        """Assigns queued requests in policy order (see the module docstring)."""
        now = self._clock()
        assigned: list[tuple[AdmissionRequest, Lease]] = []
        blocked: set[tuple[str, str | None]] = set()  # (model, pool) whose head request found no executor
        if self.predictor.stats()["num_observed"]:
            for req in self._queue:
                if req.prediction_level == "prior":
                    self._predict(req)  # queued before the predictor knew anything: ask again
        for req in self._queue.ordered(now):
            own = self.config.pools.pool_of(req.priority) if self.config.pools is not None else None
            if (req.model, own) in blocked or self._quota_blocked(req):
                continue  # behind a blocked head of its model and pool, or waits for its own tenant's blocks
            capped = self.quotas.limit(req.tenant) is not None
            allows = functools.partial(self.quotas.allows, req.tenant) if capped else None
            placement, _ = self.placer.choose(req, now, allows)
            if placement is None:
                if allows is None or self.placer.choose(req, now)[0] is None:
                    blocked.add((req.model, own))  # no executor has room: the requests behind it wait
                continue  # else only its tenant's quota keeps it off those with room: it is skipped
            self._queue.remove(req.request_id)
            lease = Lease(
                lease_id=req.lease_id or uuid.uuid4().hex, request_id=req.request_id,
                executor_id=placement.executor.executor_id,
                num_blocks=placement.num_blocks, tenant=req.tenant, assigned_at=now,
                num_prompt_tokens=req.num_prompt_tokens, n=max(1, req.n),
                predicted_output_tokens=req.predicted_output_tokens,
                num_hit_tokens=placement.hit_tokens, reserved_blocks=placement.num_blocks,
                expires_at=now + self.config.lease_ttl_s,
            )
            self.lease_table.grant(lease, placement.executor)
            self.waits.on_dispatch(now)
            assigned.append((req, lease))
        return assigned

    # -- executor reports --------------------------------------------------------
    def on_capacity(self, executor_id: str, num_free_blocks: int, num_running: int, num_waiting: int,
                    lease_ids: Iterable[str], lease_num_blocks: Mapping[str, int] | None = None) -> None:
        """Applies an executor's capacity report.

        Args:
            executor_id: the reporting executor (unknown ids are ignored).
            num_free_blocks, num_running, num_waiting: its engine's counters.
            lease_ids: leases it holds (they become acknowledged).
            lease_num_blocks: lease id → KV blocks its requests hold now (all
                choices). A positive count replaces the lease's charge to its
                tenant's quota; 0 keeps the admission reservation
                (``scheduler.lease_table``).
                Leases of other executors or unknown leases are ignored.

        Raises:
            InvalidArgument: a negative block count.
        """
        counts = dict(lease_num_blocks or {})
        bad = {k: v for k, v in counts.items() if v < 0}
        if bad:
            raise InvalidArgument(f"lease_num_blocks must be >= 0, got {bad}")
        listed = set(lease_ids) | set(counts)
        self.registry.report(executor_id, num_free_blocks, num_running, num_waiting, listed)
        self.lease_table.on_report(executor_id, listed, counts)

    def on_kv_events(self, executor_id: str, stored: Iterable[bytes], removed: Iterable[bytes],
                     reset: bool = False) -> None:
        """Applies an executor's prefix-cache events (``reset``: a full snapshot follows,
        forget what it held before). Events of an unknown executor are ignored."""
        if self.registry.get(executor_id) is None:
            return
        if reset:
            self.prefix_index.drop(executor_id)
        self.prefix_index.removed(executor_id, removed)
        self.prefix_index.stored(executor_id, stored)

    def release(self, lease_id: str, num_completion_tokens: int | None = None,
                num_generated_tokens: int | None = None) -> bool:
        """Ends a lease (idempotent): the request finished or was cancelled.

        ``num_completion_tokens`` (all choices together, only when every choice
        finished) teaches the predictor. ``num_generated_tokens`` (all choices
        together, however the request ended) is charged to the tenant's
        tokens_per_min and counted as served; when None, ``num_completion_tokens``
        stands in for it, so a caller that leaves mid-stream still pays for what
        was generated.
        """
        lease = self.lease_table.release(lease_id)
        if lease is None:
            return False
        generated = num_generated_tokens if num_generated_tokens is not None else num_completion_tokens
        if generated is not None:
            self.rates.completed(lease.tenant, generated, self._clock())
            self.waits.on_release(self._clock(), lease.num_prompt_tokens + generated)
        if num_completion_tokens is not None:
            per_choice = round(num_completion_tokens / lease.n)
            self.predictor.observe(lease.tenant, lease.num_prompt_tokens, per_choice, lease.predicted_output_tokens)
        return True

    def drain_executor(self, executor_id: str) -> bool:
        """Routes nothing new to an executor any more (it finishes its leases, then
        leaves); False if it is unknown. Its leases stay valid until released or expired."""
        executor = self.registry.get(executor_id)
        if executor is None:
            return False
        executor.draining = True
        return True

    def remove_executor(self, executor_id: str) -> list[Lease]:
        """Drops an executor and returns its leases, now detached.

        A detached lease keeps its quota charge and its request id: its executor may
        only have lost its link to the scheduler and still run the request, holding
        its blocks. It ends like any lease: released by its gateway (an executor
        that died fails its Execute call), or expired ``lease_ttl_s`` after its last
        renewal or listing; or it is taken back by the executor when that registers
        again under the same id and lists it (``on_capacity``).
        """
        leases = self.registry.remove(executor_id)
        self.prefix_index.drop(executor_id)
        for lease in leases:
            lease.listed = False  # no executor lists it now: it may expire
        return leases

    def renew(self, lease_id: str) -> float | None:
        """Extends a live lease by ``lease_ttl_s`` from now; returns the seconds it now
        has left, or None for an unknown (released, expired) lease."""
        return self.lease_table.renew(lease_id)

    def expire_leases(self) -> list[Lease]:
        """Releases the expired leases their executors do not list (``scheduler.lease_table``)."""
        expired = self.lease_table.expired()
        for lease in expired:
            self.release(lease.lease_id)
        return expired

    def clock(self) -> float:
        """The core's clock now (seconds)."""
        return self._clock()

    def lease(self, lease_id: str) -> Lease | None:
        """A held lease, or None."""
        return self.lease_table.get(lease_id)

    def num_leases(self, executor_id: str | None = None) -> int:
        """Leases currently held (on ``executor_id`` only, when given: those detached
        from it by a lost link included)."""
        if executor_id is None:
            return len(self.lease_table)
        return self.lease_table.count(executor_id)
