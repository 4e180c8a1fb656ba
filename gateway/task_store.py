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
whichever transition came first. A finished record lives ``ttl_s`` seconds
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
    async def create(self, record: TaskRecord) -> None:
        """Stores a new QUEUED record.

        Raises:
            ResourceExhausted: the store holds its maximum of unfinished tasks.
            ValueError: a record with this id exists (ids are made unique by the caller).
        """

    @abc.abstractmethod
    async def get(self, task_id: str) -> TaskRecord | None:
        """The record, or None when unknown or expired."""

    @abc.abstractmethod
    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState,
                         **changes) -> TaskRecord | None:
        """Moves the record to ``to_state`` (and sets ``changes``, TaskRecord fields)
        if its state is one of ``from_states``, atomically; a final state starts
        its TTL.

        Returns:
            The new record; None if the record is gone or not in ``from_states``.
        """

    async def check(self) -> None:
        """Checks that the store can be reached (at start; a no-op in memory).

        Raises:
            ConnectionError: it cannot.
        """

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

    def __len__(self) -> int:
        return len(self._records)

    async def create(self, record: TaskRecord) -> None:
        if record.task_id in self._records:
            raise ValueError(f"task {record.task_id!r} exists")
        if len(self._records) >= self.max_tasks:
            self._purge(make_room=True)
        if len(self._records) >= self.max_tasks:
            raise ResourceExhausted(f"the task store holds {self.max_tasks} unfinished tasks (max_tasks)",
                                    retry_after_s=1.0)
        self._records[record.task_id] = record

    async def get(self, task_id: str) -> TaskRecord | None:
        self._expire(task_id)
        return self._records.get(task_id)

    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState,
                         **changes) -> TaskRecord | None:
        self._expire(task_id)
        record = self._records.get(task_id)
        if record is None or record.state not in tuple(from_states):
            return None
        record = self._records[task_id] = replace(record, state=to_state, **changes)
        if to_state.finished:
            self._expires[task_id] = self._clock() + self.ttl_s
        return record

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
