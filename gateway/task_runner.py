"""Runs async tasks in the background and keeps their records (pure core, no gRPC).

``submit`` stores a QUEUED record claimed by this gateway (attempt 1) and
starts the task's *work* — a coroutine function the gateway supplies that runs
the generation and returns its result as bytes — as an asyncio task; each task
runs as a ``TaskRun`` (``gateway.task_run``: its attempts, the ``TaskHooks`` its
work reports through, the outcome that becomes its final state, retries, and
its writes fenced by attempt). ``cancel`` and a ``CancelTask`` seen end it
CANCELLED; ``close`` (the gateway stopping) hands it back (QUEUED, unowned) to
another gateway with a shared store, or fails it (UNAVAILABLE) in memory.

**Durable tasks** (a shared store, Redis, and a ``resume`` function that builds
a task's work again from its stored record):

* *Leases.* The owner renews each running task's lease every ``heartbeat_s``
  (``TaskStore.renew``); a renewal refused (the task was cancelled elsewhere,
  or claimed by another gateway after our lease lapsed) cancels the local work
  without writing anything.
* *Takeover.* Every ``claim_poll_s`` the runner claims tasks whose lease
  lapsed (their gateway died, was SIGKILLed or stalled) or that were handed
  back, and runs them through ``resume``. A task claimed for the
  ``max_attempts + 1``-th time ends FAILED (UNAVAILABLE, with the last reason).
* *Retries* and *exactly one result*: ``gateway.task_run`` (a work that
  raises ``Unavailable`` runs again under the next attempt number; every write
  of a holder is fenced by its attempt number).

**Durable callbacks.** A final transition of a task with a callback names
this gateway its ``callback_owner`` with a lease (``lease_s``); ``on_final``
delivers it while the heartbeat renews that lease (``TaskStore.claim_callback``).
A gateway that dies mid-delivery leaves the callback ``pending``: once its
lease lapses, another gateway's takeover loop claims it
(``TaskStore.claimable_callbacks``) and calls ``on_final`` again, which POSTs
it anew (the receiver deduplicates by task id). A stopping gateway hands its
deliveries back (unowned) so another one takes them at once. Only a runner
with ``delivers_callbacks`` claims deliveries.

Why not arq or taskiq: both are at-least-once job queues whose workers import
the job's function and (arq by default) pickle its arguments; neither fences a
stale worker's completion by an attempt number, and neither knows that a task
of ours must keep one record (state, result, queue position, callback state)
readable by ``GetTask`` on any gateway. What we need is four compare-and-sets
on that record (create, claim, renew, transition) and a sorted set of leases:
smaller than an adapter over a job library would be.

Tenancy: ``get`` and ``cancel`` raise ``NotFound`` for another tenant's task,
with the same message as for an unknown one, so ids leak nothing.

The callback POST itself lives in ``gateway.callback_delivery``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Awaitable, Callable

from gateway.task_run import Resume, TaskRun, Work
from gateway.task_store import FINISHED, UNFINISHED, TaskRecord, TaskState, TaskStore
from gateway.task_wait import DEFAULT_MAX_WAIT_S
from meshserve.errors import MeshError, NotFound, Unavailable
from meshserve.timeouts import wait_for

log = logging.getLogger(__name__)

# the bound on a tenant's unfinished tasks when its tenants-file entry sets none
# (``meshserve gateway --max-unfinished-tasks-per-tenant``)
DEFAULT_MAX_UNFINISHED_PER_TENANT = 1000


OnFinal = Callable[[TaskRecord], Awaitable[None]]  # after the one final transition (callbacks)


class TaskRunner:
    """Background tasks of one gateway over a ``TaskStore``.

    Args:
        store: where records live.
        clock: Unix time in seconds (the records' timestamps and leases).
        heartbeat_s: with a shared store, how often the leases of running tasks are
            renewed (seconds); a cancel served by another gateway is seen within it.
        owner: this gateway's id in the records (default: ``gateway-<12 hex>``).
        lease_s: how long a claim lasts without a renewal (seconds; > heartbeat_s).
        claim_poll_s: how often lapsed or handed-back tasks are looked for (seconds).
        max_attempts: the most attempts of one task (claims and retries together).
        retry_backoff_s: the first retry's delay; each next one doubles (seconds).
        resume: builds a task's work from its record; None: no retries, no takeover.
        on_final: awaited (in the background) with the record of each final
            transition this runner made (the callback delivery), and of each
            pending callback it took over from a dead gateway.
        delivers_callbacks: whether this gateway delivers callbacks (claims them).
        submit_timeout_s: the bound of a submit's store write (seconds); past it the
            submit is UNAVAILABLE (and its record, should it land, is ended).
        max_wait_s: the longest a task waits out the scheduler's refusals before it
            fails (seconds; ``gateway.task_wait``).
        max_unfinished_per_tenant: the most unfinished tasks a tenant may have in the
            store (tasks), for a submit that names no bound of its own (>= 1).
    """

    def __init__(self, store: TaskStore, clock: Callable[[], float] = time.time, heartbeat_s: float = 1.0, *,
                 owner: str | None = None, lease_s: float = 10.0, claim_poll_s: float = 1.0, max_attempts: int = 3,
                 retry_backoff_s: float = 0.5, resume: Resume | None = None, on_final: OnFinal | None = None,
                 delivers_callbacks: bool = True, submit_timeout_s: float = 3.0,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 max_unfinished_per_tenant: int = DEFAULT_MAX_UNFINISHED_PER_TENANT):
        if not lease_s > heartbeat_s > 0 or max_attempts < 1 or not max_wait_s > 0 or max_unfinished_per_tenant < 1:
            raise ValueError(f"need lease_s > heartbeat_s > 0, max_attempts >= 1, max_wait_s > 0 and "
                             f"max_unfinished_per_tenant >= 1, got {lease_s}, {heartbeat_s}, {max_attempts}, "
                             f"{max_wait_s}, {max_unfinished_per_tenant}")
        self.store = store
        self.clock = clock
        self.heartbeat_s, self.lease_s, self.claim_poll_s = heartbeat_s, lease_s, claim_poll_s
        self.owner = owner or f"gateway-{uuid.uuid4().hex[:12]}"
        self.max_attempts, self.retry_backoff_s = max_attempts, retry_backoff_s
        self.max_wait_s = max_wait_s
        self.max_unfinished_per_tenant = max_unfinished_per_tenant
        self.resume, self.on_final, self.delivers_callbacks = resume, on_final, delivers_callbacks
        self.submit_timeout_s = submit_timeout_s
        self._running: dict[str, TaskRun] = {}
        self._delivering: dict[str, asyncio.Task] = {}  # task id -> its callback delivery (held here)
        self._finals: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._closing = False
        self._draining = False  # set by drain: nothing more is claimed from other gateways
        self._claiming = asyncio.Lock()  # held by a takeover step (drain waits for the one under way)
        self._stopping = asyncio.Event()  # set by close: the loops stop between steps

    @property
    def closing(self) -> bool:
        """Whether the gateway is stopping (``close`` began)."""
        return self._closing

    @property
    def num_running(self) -> int:
        """Tasks whose work is running in this gateway."""
        return len(self._running)

    def start(self) -> None:
        """Starts the heartbeat and (with ``resume``) the takeover loop, for a shared store;
        idempotent. ``submit`` calls it."""
        if self._loops or self._closing or not self.store.shared:
            return
        self._loops.append(asyncio.create_task(self._every(self.heartbeat_s, self._heartbeat), name="task heartbeat"))
        if self.resume is not None:
            self._loops.append(asyncio.create_task(self._every(self.claim_poll_s, self._take_over),
                                                   name="task takeover"))

    async def submit(self, record: TaskRecord, work: Work, max_unfinished: int | None = None) -> TaskRecord:
        """Stores ``record`` (state QUEUED, claimed here: attempt 1) and starts ``work``,
        unless its tenant already has ``max_unfinished`` unfinished tasks in the store
        (None: ``max_unfinished_per_tenant``).

        Returns:
            The stored record.

        Raises:
            ResourceExhausted: its tenant is at its bound, or the store is full of
                unfinished tasks; nothing is stored.
            Unavailable: the store cannot be reached, or this gateway is stopping.
        """
        if self._closing:
            raise Unavailable("the gateway is stopping")
        self.start()
        record = replace(record, owner=self.owner, attempt=1, lease_until=self.clock() + self.lease_s)
        try:
            try:
                await wait_for(self.store.create(record, max_unfinished or self.max_unfinished_per_tenant),
                               self.submit_timeout_s)
            except asyncio.TimeoutError:
                raise Unavailable(f"the task store did not answer within {self.submit_timeout_s} s") from None
        except Unavailable:
            # the write may still land once the store answers again (it was sent): end that
            # record, so a task whose caller was told UNAVAILABLE is never run by a takeover
            self._background(self._void(record.task_id), f"task {record.task_id} void")
            raise
        self._launch(record.task_id, 1, work)
        return record

    async def _void(self, task_id: str, tries: int = 10) -> None:
        """Ends a record whose submit failed (FAILED, UNAVAILABLE), retrying while the store is down."""
        for _ in range(tries):
            try:
                await self.store.transition(task_id, UNFINISHED, TaskState.FAILED, fence=1, owner="",
                                            finished_at=self.clock(), error_code="UNAVAILABLE",
                                            error_message="its submit failed: the task store did not answer",
                                            callback_state="failed", callback_error="its submit failed")
                return
            except MeshError:
                await asyncio.sleep(self.heartbeat_s)

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
        cancelled = await self.store.transition(task_id, UNFINISHED, TaskState.CANCELLED, finished_at=self.clock(),
                                                owner="", queue_position=-1, **self.callback_claim())
        if cancelled is not None:
            self.handle_final(cancelled)
        self._cancel(task_id)
        return cancelled or await self.get(tenant, task_id)  # it finished meanwhile

    async def drain(self, grace_s: float, calls_done: asyncio.Event | None = None) -> None:
        """The start of a stop: claims no more tasks or callback deliveries that other
        gateways left (a task claimed now would only be handed back, one attempt used),
        keeps the leases of its own, and waits at most ``grace_s`` seconds until
        nothing runs: no task, no callback delivery or final write, no takeover step
        that was under way (what it claimed runs like any other task) and, with
        ``calls_done``, no call in flight (until it is set: a SubmitTask in flight may
        still add a task). ``close`` then hands back or fails what is left."""
        self._draining = True
        calls = asyncio.ensure_future(calls_done.wait()) if calls_done is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        try:
            while (left := deadline - loop.time()) > 0:
                busy = {r.task for r in self._running.values() if r.task is not None} | set(self._finals)
                if calls is not None and not calls.done():
                    busy.add(calls)
                if not busy and not self._running and not self._claiming.locked():
                    return
                # re-read at least every 0.1 s: a claim or a submit adds work without a task to wait on
                if busy:
                    await asyncio.wait(busy, timeout=min(left, 0.1), return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(min(left, 0.1))
        finally:
            if calls is not None:
                calls.cancel()

    async def close(self) -> None:
        """Stops claiming; every running task is handed back (shared store) or ends
        FAILED with UNAVAILABLE (memory); waits for them. Undelivered callbacks stop."""
        self._closing = True
        # the loops end after their current step: a renewal cancelled mid-way would still
        # land (its store call is shielded) after the hand-back below and re-own the task
        self._stopping.set()
        _, late = await asyncio.wait(self._loops, timeout=self.lease_s) if self._loops else ((), ())
        for loop in late:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        tasks = [r.task for r in self._running.values()]
        for task_id, running in list(self._running.items()):
            running.hand_back = self.store.shared
            self._cancel(task_id)
        await asyncio.gather(*tasks, return_exceptions=True)
        delivering = list(self._delivering)
        for task in list(self._finals):
            task.cancel()
        await asyncio.gather(*self._finals, return_exceptions=True)
        for task_id in delivering if self.store.shared else ():  # another gateway delivers them at once
            try:
                await self.store.transition(task_id, FINISHED, None, callback_fence=self.owner, callback_owner="",
                                            callback_lease_until=0.0)
            except MeshError as exc:
                log.warning("task %s: callback not handed back (its lease will lapse): %s", task_id, exc)

    def _launch(self, task_id: str, attempt: int, work: Work) -> None:
        running = TaskRun(self, task_id, attempt)
        self._running[task_id] = running
        running.task = asyncio.create_task(self._run(task_id, running, work), name=f"task {task_id}")

    def _cancel(self, task_id: str) -> None:
        """Cancels the task's work; one not started yet is cancelled as it starts, so
        that its work still sees the cancel (and runs its cleanup) and its state is final."""
        running = self._running.get(task_id)
        if running is None:
            return
        if running.started:
            running.task.cancel()
        else:
            running.cancel_at_start = True

    async def _run(self, task_id: str, running: TaskRun, work: Work) -> None:
        running.started = True
        if running.cancel_at_start:
            asyncio.current_task().cancel()  # raised at the work's first await, inside its own try
        try:
            while work is not None:
                work = await running.run_attempt(work)
        finally:
            self._running.pop(task_id, None)

    def callback_claim(self) -> dict:
        """The fields of a final transition that make this gateway its callback's deliverer."""
        if not self.delivers_callbacks:
            return {}
        return {"callback_owner": self.owner, "callback_lease_until": self.clock() + self.lease_s}

    def handle_final(self, record: TaskRecord) -> None:
        """Hands the record of a final transition (or of a callback delivery taken over)
        to ``on_final``, in the background; a delivery this gateway holds is renewed by
        the heartbeat while it runs."""
        if self.on_final is None:
            return
        task = self._background(self.on_final(record), f"task {record.task_id} final")
        if record.callback_pending and record.callback_owner == self.owner:
            self._delivering[record.task_id] = task
            task.add_done_callback(lambda _t, task_id=record.task_id: self._delivering.pop(task_id, None))

    def _background(self, coro, name: str) -> asyncio.Task:
        """Runs ``coro`` in the background; ``close`` cancels what is left."""
        task = asyncio.create_task(coro, name=name)
        self._finals.add(task)
        task.add_done_callback(self._finals.discard)
        return task

    async def _every(self, period_s: float, step: Callable[[], Awaitable[None]]) -> None:
        while not self._closing:  # also checked: a cancel inside a Redis call may come back as a ConnectionError
            try:
                await wait_for(self._stopping.wait(), period_s)  # the period, or until close
            except asyncio.TimeoutError:
                pass
            if self._closing:
                return
            try:
                await step()
            except MeshError as exc:  # the store is down for now: keep running
                log.warning("task store: %s", exc)

    async def _heartbeat(self) -> None:
        """Renews every running task's lease and every delivery's; a refused renewal
        cancels its work (or its delivery: another gateway took it over)."""
        now = self.clock()
        for task_id, delivery in list(self._delivering.items()):
            if await self.store.claim_callback(task_id, self.owner, now, self.lease_s) is None:
                self._delivering.pop(task_id, None)
                delivery.cancel()
        lease_until = self.clock() + self.lease_s
        for task_id, running in list(self._running.items()):
            async with running.lock:
                if running.lost or not running.started:
                    continue
                if not await self.store.renew(task_id, self.owner, running.attempt, lease_until):
                    running.lost = True
                    running.task.cancel()

    async def _take_over(self) -> None:
        """Claims the tasks whose lease lapsed (or that were handed back) and runs them;
        then the pending callbacks whose delivery lease lapsed, and delivers them.
        Nothing while draining (``drain`` waits for a step under way)."""
        async with self._claiming:
            if not self._draining:
                await self._take_over_step()

    async def _take_over_step(self) -> None:
        await self._take_over_tasks()
        if self.delivers_callbacks and self.on_final is not None:
            now = self.clock()
            for task_id in await self.store.claimable_callbacks(now):
                if self._closing or self._draining or task_id in self._delivering:
                    continue
                record = await self.store.claim_callback(task_id, self.owner, now, self.lease_s)
                if record is not None:
                    log.info("task %s: callback delivery taken over (%d attempts made)", task_id,
                             record.callback_attempts)
                    self.handle_final(record)

    async def _take_over_tasks(self) -> None:
        now = self.clock()
        for task_id in await self.store.claimable(now):
            if self._closing or self._draining or task_id in self._running:
                continue
            record = await self.store.claim(task_id, self.owner, now, self.lease_s)
            if record is None:
                continue  # another gateway was quicker
            log.info("task %s: taken over (attempt %d)", task_id, record.attempt)
            running = TaskRun(self, task_id, record.attempt)
            if record.attempt > self.max_attempts:
                self._running[task_id] = running
                try:
                    await running.finish(TaskState.FAILED, error_code="UNAVAILABLE",
                                       error_message=f"gave up after {self.max_attempts} attempts "
                                                     f"({record.last_error or 'its gateway stopped'})")
                finally:
                    self._running.pop(task_id, None)
                continue
            self._running[task_id] = running
            running.task = asyncio.create_task(self._run(task_id, running, running.work_of(record)),
                                               name=f"task {task_id}")
