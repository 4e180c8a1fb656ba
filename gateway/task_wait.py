"""Tasks waiting out a refusal: one line per tenant, and a bound on the wait.

A task the scheduler refuses for now (RESOURCE_EXHAUSTED with a retry delay: its
tenant over ``requests_per_s`` or ``tokens_per_min``, the admission queue full,
displaced by a higher priority) is not failed: ``gateway.task_api`` waits the
delay and asks again. Asking again is where many waiting tasks could hurt:

* **One line per tenant and priority.** A tenant's waiting tasks of one priority
  queue in a first-come line (an ``asyncio.Lock``, whose waiters are woken in
  order). Only the task at its head sleeps out its delay and asks the scheduler
  again; it leaves the line once admitted (its first event, or an executor
  assigned), and the next one asks. So N waiting tasks cost about one refused
  Admit per admission, not N each time a bucket refills (N²/2 in all), and the
  first refused is the first admitted: a burst cannot starve an old task. A new
  task whose line is not empty joins it before asking at all, unless the result
  cache holds its answer (``gateway.task_api``); a task of a higher priority is in
  a line of its own, so it never waits behind lower ones.
* **A bound.** A task waits at most ``max_wait_s`` from its first refusal (on the
  gateway running it); a delay that would take it past the bound, or a line that
  does not reach it in time, fails it with the last refusal's
  RESOURCE_EXHAUSTED, so no task waits forever (e.g. a queue that is never
  short enough for its prompt).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from meshserve.errors import ResourceExhausted

MIN_HOLD_S = 0.25  # the shortest wait before a refused task asks again (seconds)
DEFAULT_MAX_WAIT_S = 600.0  # how long a task may wait out refusals (seconds; --task-max-wait-s)


class WaitingLines:
    """The tenants' lines of waiting tasks (see the module docstring).

    Args:
        max_wait_s: the longest a task waits out refusals, from its first (seconds).
        clock: monotonic seconds.

    Raises:
        ValueError: ``max_wait_s`` <= 0.
    """

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S, clock: Callable[[], float] = time.monotonic):
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.clock = clock
        self._lines: dict[tuple[str, int], _Line] = {}

    def place(self, tenant: str, priority: int = 0) -> Place:
        """A task's place in the line of its tenant and priority (taken at its first
        refusal, or when it joins a busy line)."""
        return Place(self, (tenant, priority))

    def __len__(self) -> int:
        """Lines in use (a line nobody holds or waits for is dropped)."""
        return len(self._lines)

    def _line(self, key: tuple[str, int]) -> _Line:
        return self._lines.setdefault(key, _Line())

    def _peek(self, key: tuple[str, int]) -> _Line | None:
        return self._lines.get(key)

    def _drop_if_idle(self, key: tuple[str, int]) -> None:
        """Forgets an idle line: a tenant cycling through priorities leaves none behind."""
        line = self._lines.get(key)
        if line is not None and not line.busy:
            del self._lines[key]


class _Line:
    """A first-come lock and the count of tasks waiting for it (``asyncio.Lock``
    alone reads unlocked between a release and its next holder's waking)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.num_waiting = 0

    @property
    def busy(self) -> bool:
        return self.lock.locked() or self.num_waiting > 0

    async def acquire(self) -> None:
        self.num_waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.num_waiting -= 1


class Place:
    """One task's standing in its line. ``wait(refusal)`` after each refusal;
    ``admitted()`` once a run of it was admitted; ``leave()`` when the task ends."""

    def __init__(self, lines: WaitingLines, key: tuple[str, int]):
        self._lines, self._key = lines, key
        self._held: _Line | None = None  # the line it heads
        self.first_refused_at: float | None = None

    @property
    def busy(self) -> bool:
        """Whether tasks wait in its line (and it is not at the head)."""
        line = self._lines._peek(self._key)
        return line is not None and line.busy and self._held is None

    async def _acquire(self, timeout_s: float) -> None:
        """Waits for the head of its line (raises TimeoutError past ``timeout_s``)."""
        line = self._lines._line(self._key)
        try:
            async with asyncio.timeout(timeout_s):
                await line.acquire()
        except BaseException:
            self._lines._drop_if_idle(self._key)
            raise
        self._held = line

    async def join_if_busy(self) -> None:
        """Before a task's first ask: when tasks of its tenant wait in the line, waits
        its turn behind them (bounded like a refusal's wait).

        Raises:
            ResourceExhausted: its turn did not come within the bound.
        """
        if not self.busy:
            return
        self.first_refused_at = self._lines.clock()
        try:
            await self._acquire(self._lines.max_wait_s)
        except TimeoutError:
            raise ResourceExhausted(f"the task waited {self._lines.max_wait_s:g} s behind its tenant's tasks "
                                    "refused for now and may wait no longer (--task-max-wait-s)", None) from None

    def delay_s(self, refusal: ResourceExhausted) -> float:
        """The wait the refusal asks for (at least ``MIN_HOLD_S``; seconds)."""
        return max(MIN_HOLD_S, refusal.retry_after_s or 0.0)

    async def wait(self, refusal: ResourceExhausted) -> None:
        """Waits until the task may ask again: at the head of its tenant's line, the
        refusal's delay after it came.

        Raises:
            ResourceExhausted: the wait would pass the bound (no retry delay: the
                task is over; the message names the refusal and the bound).
        """
        now = self._lines.clock()
        if self.first_refused_at is None:
            self.first_refused_at = now
        deadline = self.first_refused_at + self._lines.max_wait_s
        ready_at = now + self.delay_s(refusal)
        if ready_at > deadline:
            raise self._over(refusal, now)
        if self._held is None:
            try:
                await self._acquire(deadline - now)  # behind the tenant's tasks refused before it
            except TimeoutError:
                raise self._over(refusal, self._lines.clock()) from None
        await asyncio.sleep(max(0.0, ready_at - self._lines.clock()))

    def _over(self, refusal: ResourceExhausted, now: float) -> ResourceExhausted:
        waited = now - (self.first_refused_at or now)
        return ResourceExhausted(f"{refusal}; the task waited {waited:.1f} s for admission and may wait at most "
                                 f"{self._lines.max_wait_s:g} s (--task-max-wait-s)", None)

    def admitted(self) -> None:
        """A run was admitted (queued at the scheduler, assigned, or answered): the
        next waiting task of the tenant may ask."""
        self.leave()

    def leave(self) -> None:
        """Gives up its place at the head of the line, if it holds it (idempotent); an
        idle line is dropped."""
        if self._held is not None:
            line, self._held = self._held, None
            line.lock.release()
            self._lines._drop_if_idle(self._key)
