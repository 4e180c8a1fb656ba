"""The async task store: one record per submitted task (pure core, no gRPC).

``TaskStore`` is a small async interface with two backends chosen by URL
(``gateway.task_store_registry.open_task_store``): ``memory`` (this module; the
default, one gateway) and ``redis://host:port/db`` (``gateway.redis_task_store``;
gateways share it).

A record moves only forward, and only through ``transition``, a compare-and-set
on its state::

    QUEUED ──▶ RUNNING ──▶ SUCCEEDED | FAILED | CANCELLED
       └──────────────────▶ SUCCEEDED | FAILED | CANCELLED

so a task cancelled while its result arrives ends in exactly one final state,
whichever transition came first. (One step goes back: a stopping gateway hands
its RUNNING task back to QUEUED, unowned, for another gateway to claim.)

**Claims and fencing** (durable tasks, ``gateway.task_runner``). An unfinished
record names its ``owner`` (the gateway running it), an ``attempt`` number and
a ``lease_until`` (Unix s) that the owner renews (``renew``, its heartbeat).
``claimable`` lists unfinished records that are unowned or whose lease lapsed;
``claim`` takes one atomically (``attempt`` + 1, new owner and lease). Every
write of a holder names its attempt (``transition(..., fence=N)``): once
another gateway claimed the task, the old holder's writes are refused, so a
task has exactly one final state and one result, whoever ran it.

**Callback deliveries** are claimed the same way. The final transition of a
task with a ``callback_url`` names a ``callback_owner`` (the gateway that will
POST it) and a ``callback_lease_until``; the owner renews it while it delivers
(``claim_callback`` by the same owner), and writes each attempt fenced by its
name (``transition(..., callback_fence=owner)``). A finished record whose
callback is still ``pending`` and whose delivery lease lapsed (its gateway died
mid-delivery) is listed by ``claimable_callbacks`` and taken over by another
gateway with ``claim_callback``.

**A bound per tenant.** ``create(record, max_unfinished=N)`` refuses a record
whose tenant already has N unfinished (QUEUED or RUNNING) records, with
``ResourceExhausted`` naming the tenant's count and its bound, and stores nothing; the count and the
add are one atomic step, so concurrent submits (on one gateway, or on gateways
sharing a Redis) never pass the bound together. A record stops counting at its
final transition, and when it expires (Redis: ``unfinished_ttl_s``); in Redis a
tenant found at its bound is checked first for records gone or ended without
leaving its count (``gateway.redis_task_store``).
``unfinished_count(tenant)`` reads the count.

A finished record lives ``ttl_s`` seconds
after it finished, then it is gone (``get`` returns None); unfinished records
never expire in memory (the gateway that runs them is alive) and live
``unfinished_ttl_s`` in Redis (a gateway that died mid-task leaves no record
behind forever).

The store keeps the result as opaque bytes (the gateway stores a serialized
message) and the submit span's W3C ``traceparent``, so that polls can link to it.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from meshserve.errors import InvalidArgument, ResourceExhausted


class TaskState(enum.IntEnum):
    """A task's state; the values are ``meshserve.v1.TaskState``'s numbers."""

    QUEUED = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def finished(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED (final states)."""
        return self >= TaskState.SUCCEEDED


UNFINISHED = (TaskState.QUEUED, TaskState.RUNNING)
FINISHED = (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED)
_SAME = None  # transition's to_state: keep the record's state


@dataclass(frozen=True)
class TaskRecord:
    """One task as the store keeps it.

    Attributes:
        task_id: the task's id.
        tenant: the tenant that submitted it; only that tenant may see it.
        request_id: the request id of its generation.
        state: its current ``TaskState``.
        created_at / started_at / finished_at: Unix times in seconds (0: not yet).
        result: SUCCEEDED: the serialized result (opaque bytes); else empty.
        error_code / error_message: FAILED: a gRPC status code name
            (``"UNAVAILABLE"``) and its message; else empty.
        traceparent: the W3C ``traceparent`` of the submit span ("" when untraced).
        request: the serialized ``GenerateRequest`` (what a gateway taking the task
            over runs again); empty when the task cannot be taken over.
        owner: the gateway running it ("" when unowned: claimable at once).
        attempt: how many times it was claimed or retried (the fencing token).
        lease_until: the owner's lease ends (Unix s); past it the task is claimable.
        queue_position / estimated_wait_s: while it waits in the scheduler's queue,
            its 0-based position and estimated wait (s); -1 when not queued.
        last_error: why the previous attempt ended ("" on the first).
        callback_url: where its result is POSTed when it ends ("" for none).
        callback_state: "" (none), ``pending``, ``delivered`` or ``failed``.
        callback_attempts: delivery attempts made.
        callback_error: the last delivery failure ("" when none).
        callback_owner: the gateway delivering its callback ("" when none does).
        callback_lease_until: that gateway's delivery lease ends (Unix s).
    """

    task_id: str
    tenant: str
    request_id: str = ""
    state: TaskState = TaskState.QUEUED
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    result: bytes = b""
    error_code: str = ""
    error_message: str = ""
    traceparent: str = ""
    request: bytes = b""
    owner: str = ""
    attempt: int = 0
    lease_until: float = 0.0
    queue_position: int = -1
    estimated_wait_s: float = 0.0
    last_error: str = ""
    callback_url: str = ""
    callback_state: str = ""
    callback_attempts: int = 0
    callback_error: str = ""
    callback_owner: str = ""
    callback_lease_until: float = 0.0

    def claimable(self, now: float) -> bool:
        """Unfinished and unowned, or its owner's lease lapsed by ``now`` (Unix s)."""
        return not self.state.finished and (not self.owner or self.lease_until <= now)

    @property
    def callback_pending(self) -> bool:
        """Finished with a callback not yet delivered nor given up."""
        return self.state.finished and bool(self.callback_url) and self.callback_state == "pending"

    def callback_claimable(self, now: float, owner: str) -> bool:
        """Its callback is pending and unowned, held by ``owner`` (a renewal), or its
        delivery lease lapsed by ``now`` (Unix s)."""
        return self.callback_pending and (self.callback_owner in ("", owner) or self.callback_lease_until <= now)

    def allows(self, from_states: tuple[TaskState, ...], fence: int | None, callback_fence: str | None) -> bool:
        """Whether a ``transition`` with these conditions applies to this record."""
        return (self.state in from_states and (fence is None or self.attempt == fence)
                and (callback_fence is None or self.callback_owner == callback_fence))


def tenant_bound_error(tenant: str, count: int, bound: int) -> ResourceExhausted:
    """The refusal of a submit over its tenant's bound (retry after 1 s): ``count`` is the
    tenant's unfinished tasks as the store counted them, which may be above ``bound``
    (a bound lowered since, or gateways sharing a store with different bounds)."""
    return ResourceExhausted(f"tenant {tenant!r} has {count} unfinished tasks (queued or running); its bound is "
                             f"{bound} (max_unfinished_tasks, default --max-unfinished-tasks-per-tenant); submit "
                             f"again once one of them finishes", retry_after_s=1.0)


class TaskStore(abc.ABC):
    """Where task records live. Every method is a coroutine; records are immutable
    snapshots (a change is a new record written with ``transition``).

    Args (of every backend):
        ttl_s: seconds a finished record lives after its final transition (> 0).
    """

    def __init__(self, ttl_s: float):
        if not ttl_s > 0:
            raise InvalidArgument(f"task TTL must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s

    @property
    def shared(self) -> bool:
        """True when other gateways may change records too (so a runner should watch
        for a CancelTask served elsewhere)."""
        return False

    @abc.abstractmethod
    async def create(self, record: TaskRecord, max_unfinished: int | None = None) -> None:
        """Stores a new QUEUED record, unless its tenant is at its bound.

        Args:
            record: the new record (unfinished).
            max_unfinished: the most unfinished records its tenant may have, this one
                included (tasks); None: no bound.

        Raises:
            ResourceExhausted: the tenant has ``max_unfinished`` or more unfinished
                records (``tenant_bound_error``, with the count), or the store holds its maximum of unfinished
                tasks; nothing is stored.
            ValueError: another record with this id exists (ids are made unique by the
                caller). A record equal to the stored one is no error: it is a retry whose
                first try landed (the Redis client retries a command whose reply was lost
                with its connection); the store is unchanged and the record counts once.
        """

    @abc.abstractmethod
    async def unfinished_count(self, tenant: str) -> int:
        """How many of ``tenant``'s records are unfinished (QUEUED or RUNNING) and not expired."""

    @abc.abstractmethod
    async def get(self, task_id: str) -> TaskRecord | None:
        """The record, or None when unknown or expired."""

    @abc.abstractmethod
    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState | None,
                         fence: int | None = None, callback_fence: str | None = None,
                         **changes) -> TaskRecord | None:
        """Moves the record to ``to_state`` (and sets ``changes``, TaskRecord fields)
        if its state is one of ``from_states``, (when ``fence`` is given) its
        attempt is still ``fence`` and (when ``callback_fence`` is given) its
        ``callback_owner`` is still that gateway, atomically; a final state starts its TTL.
        ``to_state`` None keeps the state (an update of other fields).

        Returns:
            The new record; None if the record is gone, not in ``from_states``, or
            claimed by another attempt.
        """

    @abc.abstractmethod
    async def claim(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        """Takes a claimable record (``TaskRecord.claimable``) for ``owner``: attempt + 1,
        lease until ``now + lease_s``, atomically.

        Returns:
            The claimed record; None when it is gone, finished or held by a live lease.
        """

    @abc.abstractmethod
    async def claimable(self, now: float, limit: int = 100) -> list[str]:
        """Ids of up to ``limit`` records claimable at ``now`` (Unix s)."""

    @abc.abstractmethod
    async def claim_callback(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        """Takes (or, by its owner, renews) the delivery of a pending callback
        (``TaskRecord.callback_claimable``): owner and lease until ``now + lease_s``, atomically.

        Returns:
            The record; None when it is gone, its callback is no longer pending, or
            another gateway holds a live delivery lease.
        """

    @abc.abstractmethod
    async def claimable_callbacks(self, now: float, limit: int = 100) -> list[str]:
        """Ids of up to ``limit`` finished records whose pending callback is unowned or
        whose delivery lease lapsed by ``now`` (Unix s)."""

    async def renew(self, task_id: str, owner: str, attempt: int, lease_until: float) -> bool:
        """The owner's heartbeat: extends its lease if the record is unfinished and still
        its attempt. Returns False when it is not (cancelled, finished, taken over, gone)."""
        changed = await self.transition(task_id, (TaskState.QUEUED, TaskState.RUNNING), _SAME, fence=attempt,
                                        owner=owner, lease_until=lease_until)
        return changed is not None

    async def check(self) -> None:
        """Checks that the store can be reached (at start; a no-op in memory).

        Raises:
            ConnectionError: it cannot.
        """

    async def check_at_start(self) -> str | None:
        """The gateway's check before it starts: ``check``, then whether the store's server
        can serve it (Redis: its version and the create script, ``check_serves_tasks``).
        Made once; the readiness polls run ``check`` alone.

        Returns:
            A warning to log, one line naming the store (Redis: its tasks would not
            survive its restart, ``durability_warning``), or None.

        Raises:
            ConnectionError: it cannot; one line naming the store and the reason.
        """
        await self.check()
        return None

    async def close(self) -> None:
        """Releases connections (a no-op in memory)."""


class MemoryTaskStore(TaskStore):
    """Records in a dict, bounded to ``max_tasks``.

    When full, ``create`` drops expired records, then the finished records that
    finished first; only a store full of unfinished tasks refuses a new one.

    Args:
        ttl_s: seconds a finished record lives.
        max_tasks: the most records kept (>= 1).
        clock: Unix time in seconds (tests pass a fake one).
    """

    def __init__(self, ttl_s: float = 3600.0, max_tasks: int = 10_000, clock: Callable[[], float] = time.time):
        super().__init__(ttl_s)
        if max_tasks < 1:
            raise InvalidArgument(f"max_tasks must be >= 1, got {max_tasks}")
        self.max_tasks = max_tasks
        self._clock = clock
        self._records: dict[str, TaskRecord] = {}
        self._expires: dict[str, float] = {}  # finished task id -> expiry (Unix s), in finishing order
        self._unfinished: dict[str, set[str]] = {}  # tenant -> ids of its unfinished records

    def __len__(self) -> int:
        return len(self._records)

    async def create(self, record: TaskRecord, max_unfinished: int | None = None) -> None:
        # no await below: the check and the add are one step of the event loop
        existing = self._records.get(record.task_id)
        if existing is not None:
            if existing == record:
                return  # a retry of this very create
            raise ValueError(f"task {record.task_id!r} exists")
        count = len(self._unfinished.get(record.tenant, ()))
        if max_unfinished is not None and count >= max_unfinished:
            raise tenant_bound_error(record.tenant, count, max_unfinished)
        if len(self._records) >= self.max_tasks:
            self._purge(make_room=True)
        if len(self._records) >= self.max_tasks:
            raise ResourceExhausted(f"the task store holds {self.max_tasks} unfinished tasks (max_tasks)",
                                    retry_after_s=1.0)
        self._records[record.task_id] = record
        self._unfinished.setdefault(record.tenant, set()).add(record.task_id)

    async def unfinished_count(self, tenant: str) -> int:
        return len(self._unfinished.get(tenant, ()))

    async def get(self, task_id: str) -> TaskRecord | None:
        self._expire(task_id)
        return self._records.get(task_id)

    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState | None,
                         fence: int | None = None, callback_fence: str | None = None,
                         **changes) -> TaskRecord | None:
        self._expire(task_id)
        record = self._records.get(task_id)
        if record is None or not record.allows(tuple(from_states), fence, callback_fence):
            return None
        record = self._records[task_id] = replace(record, state=to_state or record.state, **changes)
        if record.state.finished:
            self._expires[task_id] = self._clock() + self.ttl_s
            self._uncount(record)
        return record

    async def claim(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        record = await self.get(task_id)
        if record is None or not record.claimable(now):
            return None
        record = self._records[task_id] = replace(record, owner=owner, attempt=record.attempt + 1,
                                                  lease_until=now + lease_s)
        return record

    async def claimable(self, now: float, limit: int = 100) -> list[str]:
        return [t for t, r in self._records.items() if r.claimable(now)][:limit]

    async def claim_callback(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        record = await self.get(task_id)
        if record is None or not record.callback_claimable(now, owner):
            return None
        record = self._records[task_id] = replace(record, callback_owner=owner, callback_lease_until=now + lease_s)
        return record

    async def claimable_callbacks(self, now: float, limit: int = 100) -> list[str]:
        return [t for t, r in self._records.items()
                if r.callback_pending and (not r.callback_owner or r.callback_lease_until <= now)][:limit]

    def _uncount(self, record: TaskRecord) -> None:
        """Its tenant's count no longer holds it (it finished; finished ones never go back)."""
        ids = self._unfinished.get(record.tenant)
        if ids is not None:
            ids.discard(record.task_id)
            if not ids:
                del self._unfinished[record.tenant]

    def _expire(self, task_id: str) -> None:
        expires = self._expires.get(task_id)
        if expires is not None and self._clock() >= expires:
            del self._expires[task_id], self._records[task_id]

    def _purge(self, make_room: bool) -> None:
        """Drops expired records; with ``make_room``, then the oldest finished until
        one slot is free (``_expires`` is in finishing order: equal TTLs)."""
        now = self._clock()
        for task_id in [t for t, e in self._expires.items() if now >= e]:
            del self._expires[task_id], self._records[task_id]
        while make_room and self._expires and len(self._records) >= self.max_tasks:
            task_id = next(iter(self._expires))
            del self._expires[task_id], self._records[task_id]
