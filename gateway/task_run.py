"""One task whose work runs in this gateway: its attempts, one after another.

A task's *work* is a coroutine function the gateway supplies that runs the
generation and returns its result as bytes. The work gets ``TaskHooks``:
awaiting ``hooks()`` marks the task RUNNING once the scheduler has assigned an
executor; ``hooks.queued(position, wait)`` records its place in the scheduler's
queue. A ``TaskRun`` runs one attempt of the work at a time
(``gateway.task_runner.TaskRunner`` starts it, cancels it and renews its lease),
and the outcome becomes the final state:

    work returns bytes            → SUCCEEDED (result stored)
    work raises Unavailable (or an
      upstream CANCELLED)         → retried (below), else FAILED with its code
    work raises another MeshError → FAILED (its status code name and message)
    work raises anything else     → FAILED, INTERNAL (our bug; logged)
    cancel() / a CancelTask seen  → CANCELLED (the work is cancelled: its
                                     executor call is cancelled, KV freed)
    close() (gateway stopping)    → shared store: handed back (QUEUED, unowned)
                                    for another gateway; memory: FAILED, UNAVAILABLE

* *Retries.* A work that raises ``Unavailable`` (its executor went away, the
  scheduler had none) runs again after an exponential backoff
  (``retry_backoff_s`` · 2^k) under the next attempt number, at most
  ``max_attempts`` attempts in all, built again by the runner's ``resume`` from
  the task's record; the task's caller has seen nothing yet, so a retry is
  invisible but for ``attempt`` and ``last_error`` in its status.
* *Exactly one result.* Every write of a holder is fenced by its attempt
  number (``transition(..., fence=attempt)``): once another attempt owns the
  task the old holder's writes are refused (the run is then ``lost`` and writes
  nothing more), so there is one final state, one result and one ``on_final``
  call (its callback) per task, whoever ran it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from gateway.task_store import UNFINISHED, TaskRecord, TaskState, TaskStore
from meshserve.errors import MeshError

log = logging.getLogger(__name__)

# upstream failures a task runs again after: its executor or scheduler went away (a
# CANCELLED from upstream is an executor shutting down; our own cancel is CancelledError)
RETRIED_CODES = ("UNAVAILABLE", "CANCELLED")

# a task that waits (in the scheduler's queue, or out a refusal) is QUEUED; a taken-over
# task's record keeps the state its dead holder left (RUNNING), and goes back to QUEUED here
_WAITING = (TaskState.QUEUED, TaskState.RUNNING)


class Runner(Protocol):
    """What a task's run reads of its runner (``gateway.task_runner.TaskRunner``)."""

    store: TaskStore
    clock: Callable[[], float]
    heartbeat_s: float
    lease_s: float
    max_attempts: int
    retry_backoff_s: float
    resume: Resume | None

    @property
    def closing(self) -> bool:
        """Whether the gateway is stopping."""

    def callback_claim(self) -> dict:
        """The fields of a final transition that make this gateway its callback's deliverer."""

    def handle_final(self, record: TaskRecord) -> None:
        """Hands the record of a final transition to ``on_final``."""


class TaskHooks:
    """What a task's work reports while it runs (one attempt).

    ``await hooks()`` marks the task RUNNING (an executor was assigned);
    ``await hooks.queued(position, estimated_wait_s)`` records its place in the
    scheduler's queue (0-based position; seconds); ``await hooks.held(reason,
    wait_s)`` a refusal it waits out. All are fenced by ``attempt``: a stale
    attempt's reports are dropped. A report whose work is cancelled meanwhile still
    completes (``pending``): the attempt's own last write waits for it, so a late
    RUNNING cannot land over a hand-back.
    """

    def __init__(self, runner: Runner, task_id: str, attempt: int):
        self._runner, self.task_id, self.attempt = runner, task_id, attempt
        self._last: tuple[int, float] | None = None
        self.pending: asyncio.Future | None = None  # the last report's store write, run to its end

    async def __call__(self) -> None:
        await self._report((TaskState.QUEUED,), TaskState.RUNNING, started_at=self._runner.clock(),
                           queue_position=-1, estimated_wait_s=0.0)

    async def queued(self, position: int, estimated_wait_s: float) -> None:
        if self._last == (position, estimated_wait_s):
            return
        self._last = (position, estimated_wait_s)
        await self._report(_WAITING, TaskState.QUEUED, queue_position=position, estimated_wait_s=estimated_wait_s)

    async def held(self, reason: str, wait_s: float) -> None:
        """Records that the scheduler refused the task for now (QUEUED, not in its
        queue: ``queue_position`` -1) and that it is admitted again in ``wait_s``
        seconds; ``reason`` becomes its ``last_error``."""
        self._last = None
        await self._report(_WAITING, TaskState.QUEUED, queue_position=-1, estimated_wait_s=wait_s, last_error=reason)

    async def _report(self, from_states, to_state: TaskState, **changes) -> None:
        """A fenced write of this attempt, run to its end even when the work is cancelled
        (a compare-and-set once sent completes: the Redis store shields it too)."""
        self.pending = asyncio.ensure_future(self._runner.store.transition(
            self.task_id, from_states, to_state, fence=self.attempt, **changes))
        await asyncio.shield(self.pending)

    async def settled(self) -> None:
        """Returns once the last report's write has ended (its outcome is the store's)."""
        if self.pending is not None:
            await asyncio.gather(self.pending, return_exceptions=True)


Work = Callable[[TaskHooks], Awaitable[bytes]]
Resume = Callable[[TaskRecord], Work]  # a task's work again, from its record (raises MeshError when it cannot)


@dataclass
class TaskRun:
    """One task whose work runs here (module docstring); the runner sets ``task``."""

    runner: Runner = field(repr=False)
    task_id: str
    attempt: int
    task: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # orders the heartbeat's renewals with our writes
    lost: bool = False  # another attempt owns it, or it was cancelled elsewhere: write nothing
    hand_back: bool = False  # the gateway stops: give it back, unowned
    started: bool = False  # its coroutine has begun (a cancel before that would skip its cleanup)
    cancel_at_start: bool = False

    async def run_attempt(self, work: Work) -> Work | None:
        """Runs one attempt; returns the next attempt's work (a retry) or None (done)."""
        runner = self.runner
        hooks = TaskHooks(runner, self.task_id, self.attempt)
        try:
            result = await work(hooks)
        except asyncio.CancelledError:
            # the cancel is ours (close, cancel, a refused renewal) and handled here: a task
            # left "cancelling" would break the timeouts inside the store's client calls below
            asyncio.current_task().uncancel()
            await hooks.settled()  # a report cut short still lands: before the writes below, not over them
            if self.lost:
                return None
            if self.hand_back:
                await self.write(UNFINISHED, TaskState.QUEUED, owner="", lease_until=0.0,
                                 queue_position=-1, estimated_wait_s=0.0,
                                 last_error="handed back: its gateway stopped")
            elif runner.closing:
                await self.finish(TaskState.FAILED, error_code="UNAVAILABLE",
                                  error_message="the gateway stopped before the task finished")
            else:
                await self.finish(TaskState.CANCELLED)
        except MeshError as exc:
            retryable = exc.code.name in RETRIED_CODES
            if retryable and runner.resume is not None and self.attempt < runner.max_attempts and not runner.closing:
                return await self._retry(exc)
            await self.finish(TaskState.FAILED, error_code=exc.code.name, error_message=str(exc))
        except Exception as exc:  # noqa: BLE001 - our own bug: recorded as INTERNAL, like a call's
            log.exception("task %s failed", self.task_id)
            await self.finish(TaskState.FAILED, error_code="INTERNAL",
                              error_message=f"internal error: {type(exc).__name__}: {exc}")
        else:
            await self.finish(TaskState.SUCCEEDED, result=result)
        return None

    async def _retry(self, exc: MeshError) -> Work | None:
        """Moves the task to its next attempt (QUEUED again), waits the backoff, and
        builds the work again; None when the record went on without us."""
        runner = self.runner
        reason = f"attempt {self.attempt}: {exc.code.name}: {exc}"
        log.warning("task %s: %s; retrying", self.task_id, reason)
        delay_s = runner.retry_backoff_s * 2 ** (self.attempt - 1)
        record = await self.write(UNFINISHED, TaskState.QUEUED, attempt=self.attempt + 1,
                                  last_error=reason, queue_position=-1, estimated_wait_s=delay_s,
                                  lease_until=runner.clock() + runner.lease_s)
        if record is None:
            return None
        self.attempt = record.attempt

        async def after_backoff(hooks: TaskHooks) -> bytes:  # a cancel while waiting ends it like the work's
            await asyncio.sleep(delay_s)
            return await self.work_of(record)(hooks)
        return after_backoff

    def work_of(self, record: TaskRecord) -> Work:
        """``resume(record)``, or a work that raises why it cannot be resumed."""
        try:
            return self.runner.resume(record)
        except MeshError as exc:
            error = exc  # the except block unbinds exc

            async def failing(_hooks: TaskHooks) -> bytes:
                raise error
            return failing

    async def write(self, from_states, to_state: TaskState | None, **changes) -> TaskRecord | None:
        """A fenced write of the running attempt (None, and ``lost``, when refused);
        a store that cannot be reached is logged and leaves the record to its lease."""
        async with self.lock:
            try:
                record = await self.runner.store.transition(self.task_id, from_states, to_state,
                                                            fence=self.attempt, **changes)
            except MeshError as exc:
                log.warning("task %s: its record could not be written (%s): %s", self.task_id, to_state, exc)
                return None
            self.lost = record is None
            return record

    async def finish(self, state: TaskState, **changes) -> None:
        """The final transition (a no-op when the task already ended or another attempt
        owns it); the one that succeeds hands the record to ``on_final``. While the
        store does not answer it is tried again every ``heartbeat_s`` for one
        ``lease_s`` (the outcome is not thrown away over a short outage; past the
        lease another gateway may run the task again, and the fence keeps one result)."""
        runner = self.runner
        for _ in range(max(1, round(runner.lease_s / runner.heartbeat_s))):
            record = await self.write(UNFINISHED, state, finished_at=runner.clock(), owner="",
                                      queue_position=-1, **changes, **runner.callback_claim())
            if record is not None:
                runner.handle_final(record)
                return
            if self.lost or runner.closing:
                return
            await asyncio.sleep(runner.heartbeat_s)
