"""Runs async tasks in the background and keeps their records (pure core, no gRPC).

``submit`` stores a QUEUED record and starts the task's *work* — a coroutine
function the gateway supplies that runs the generation and returns its result
as bytes — as an asyncio task. The work calls ``mark_running`` once the
scheduler has assigned an executor. The outcome becomes the final state:

    work returns bytes            → SUCCEEDED (result stored)
    work raises MeshError         → FAILED (its status code name and message)
    work raises anything else     → FAILED, INTERNAL (our bug; logged)
    cancel() / a CancelTask seen  → CANCELLED (the work is cancelled: its
                                     executor call is cancelled, KV freed)
    close() (gateway stopping)    → FAILED, UNAVAILABLE

Every state change goes through the store's compare-and-set ``transition``, so
a cancel racing the result gives one final state. With a shared store (Redis)
a CancelTask may reach another gateway: each running task then checks its
record every ``cancel_poll_s`` seconds and cancels its work when the record
says CANCELLED (or is gone).

Tenancy: ``get`` and ``cancel`` raise ``NotFound`` for another tenant's task,
with the same message as for an unknown one, so ids leak nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from gateway.task_store import UNFINISHED, TaskRecord, TaskState, TaskStore
from meshserve.errors import MeshError, NotFound

log = logging.getLogger(__name__)

MarkRunning = Callable[[], Awaitable[None]]
Work = Callable[[MarkRunning], Awaitable[bytes]]


class TaskRunner:
    """Background tasks of one gateway over a ``TaskStore``.

    Args:
        store: where records live.
        clock: Unix time in seconds (the records' timestamps).
        cancel_poll_s: with a shared store, how often a running task checks its
            record for a cancel made by another gateway (seconds).
    """

    def __init__(self, store: TaskStore, clock: Callable[[], float] = time.time, cancel_poll_s: float = 1.0):
        self.store = store
        self._clock = clock
        self.cancel_poll_s = cancel_poll_s
        self._running: dict[str, asyncio.Task] = {}
        # tasks whose coroutine has begun: cancelling one before that would skip its
        # work entirely (no final state, no cleanup), so such a cancel is deferred to its start
        self._started: set[str] = set()
        self._cancel_at_start: set[str] = set()
        self._closing = False

    @property
    def num_running(self) -> int:
        """Tasks whose work is running in this gateway."""
        return len(self._running)

    async def submit(self, record: TaskRecord, work: Work) -> TaskRecord:
        """Stores ``record`` (state QUEUED) and starts ``work`` in the background.

        Returns:
            The stored record.

        Raises:
            ResourceExhausted: the store is full of unfinished tasks.
            Unavailable: the store cannot be reached.
        """
        await self.store.create(record)
        self._running[record.task_id] = asyncio.create_task(self._run(record.task_id, work),
                                                            name=f"task {record.task_id}")
        return record

    async def get(self, tenant: str, task_id: str) -> TaskRecord:
        """The tenant's task.

        Raises:
            NotFound: unknown, expired, or another tenant's task.
        """
        record = await self.store.get(task_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"task {task_id!r} not found")
        return record

    async def cancel(self, tenant: str, task_id: str) -> TaskRecord:
        """Cancels the tenant's unfinished task (a finished one is returned as it is).

        Raises:
            NotFound: as ``get``.
        """
        record = await self.get(tenant, task_id)
        if record.state.finished:
            return record
        cancelled = await self.store.transition(task_id, UNFINISHED, TaskState.CANCELLED, finished_at=self._clock())
        self._cancel(task_id)
        return cancelled or await self.get(tenant, task_id)  # it finished meanwhile

    async def close(self) -> None:
        """Cancels every running task (each ends FAILED with UNAVAILABLE) and waits for them."""
        self._closing = True
        tasks = list(self._running.values())
        for task_id in list(self._running):
            self._cancel(task_id)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _cancel(self, task_id: str) -> None:
        """Cancels the task's work; one not started yet is cancelled as it starts, so
        that its work still sees the cancel (and runs its cleanup) and its state is final."""
        task = self._running.get(task_id)
        if task is None:
            return
        if task_id in self._started:
            task.cancel()
        else:
            self._cancel_at_start.add(task_id)

    async def _run(self, task_id: str, work: Work) -> None:
        self._started.add(task_id)
        if task_id in self._cancel_at_start:
            self._cancel_at_start.discard(task_id)
            asyncio.current_task().cancel()  # raised at the work's first await, inside its own try

        async def mark_running() -> None:
            await self.store.transition(task_id, (TaskState.QUEUED,), TaskState.RUNNING, started_at=self._clock())

        watcher = asyncio.create_task(self._watch(task_id, asyncio.current_task())) if self.store.shared else None
        try:
            result = await work(mark_running)
        except asyncio.CancelledError:
            if self._closing:
                await self._finish(task_id, TaskState.FAILED, error_code="UNAVAILABLE",
                                   error_message="the gateway stopped before the task finished")
            else:
                await self._finish(task_id, TaskState.CANCELLED)
        except MeshError as exc:
            await self._finish(task_id, TaskState.FAILED, error_code=exc.code.name, error_message=str(exc))
        except Exception as exc:  # noqa: BLE001 - our own bug: recorded as INTERNAL, like a call's
            log.exception("task %s failed", task_id)
            await self._finish(task_id, TaskState.FAILED, error_code="INTERNAL",
                               error_message=f"internal error: {type(exc).__name__}: {exc}")
        else:
            await self._finish(task_id, TaskState.SUCCEEDED, result=result)
        finally:
            self._running.pop(task_id, None)
            self._started.discard(task_id)
            if watcher is not None:
                watcher.cancel()

    async def _finish(self, task_id: str, state: TaskState, **changes) -> None:
        """The final transition; a no-op when the task already ended (e.g. cancelled)."""
        try:
            await self.store.transition(task_id, UNFINISHED, state, finished_at=self._clock(), **changes)
        except MeshError as exc:  # the store is down: nothing to record the outcome in
            log.warning("task %s ended %s but its record could not be written: %s", task_id, state.name, exc)

    async def _watch(self, task_id: str, task: asyncio.Task | None) -> None:
        """Cancels ``task`` once its record is CANCELLED or gone (a CancelTask served
        by another gateway sharing the store)."""
        while True:
            await asyncio.sleep(self.cancel_poll_s)
            try:
                record = await self.store.get(task_id)
            except MeshError:
                continue  # the store is down for now: keep running
            if record is None or record.state == TaskState.CANCELLED:
                if task is not None:
                    task.cancel()
                return
