"""``meshserve up --autoscale MIN..MAX``: executor processes follow the scheduler's planner.

What KEDA or an HPA does in Kubernetes (deploy/k8s), on one machine: every
``poll_s`` the ``LocalAutoscaler`` reads ``meshserve_scheduler_desired_executors``
from the scheduler's ``/metrics`` (``scheduler.planner`` decides it: forecast
led by the cold start, reactive floor, one-at-a-time scale-down after a
cooldown), clamps it to MIN..MAX and

* starts ``executor-N`` processes while fewer run (``Mesh.add_executor``); each
  registers with the scheduler when loaded, reporting its cold start;
* sends SIGTERM to surplus ones while more run (``Mesh.drain_executor``):
  starting ones first (they serve nothing yet), then the newest ready ones, so
  the ready count never drops below what the planner asks for; the
  executor drains (nothing new is routed to it, what it runs finishes) and
  exits by itself;
* declares an executor that is not ready (SERVING) within ``start_budget_s`` of
  its start failed: it is killed (``Mesh.abandon_executor``) and, the count being
  short, replaced at the same poll; its readiness is watched for that
  whole budget (even past the mesh's ``startup_timeout_s``). A loading executor is never
  killed before that (the Kubernetes counterpart: the startup probe's budget,
  before which liveness is not asked).

``events`` records what happened when (start, ready, drain, exit, failed;
seconds of ``clock``), for the tests and the closing report.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Mapping

from meshserve.grpc_server import wait_serving

DESIRED_METRIC = "meshserve_scheduler_desired_executors"
LOAD_METRIC = "meshserve_scheduler_load_tokens_per_second"
MAX_POLLS = 3600  # polls kept (the last hour at one a second)


def parse_range(text: str) -> tuple[int, int]:
    """``"MIN..MAX"`` → (min, max).

    Raises:
        ValueError: not two integers with 0 <= MIN <= MAX and MAX >= 1.
    """
    match = re.fullmatch(r"\s*(\d+)\s*\.\.\s*(\d+)\s*", text)
    if not match or int(match[1]) > int(match[2]) or int(match[2]) < 1:
        raise ValueError(f"--autoscale must be MIN..MAX with 0 <= MIN <= MAX, MAX >= 1 (e.g. 1..4), got {text!r}")
    return int(match[1]), int(match[2])


def read_gauge(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled gauge ``name`` in a Prometheus text page, or None if absent."""
    match = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", metrics_text, re.MULTILINE)
    return float(match[1]) if match else None


def read_desired(metrics_text: str) -> int | None:
    """The desired executor count in a Prometheus text page, or None if absent."""
    value = read_gauge(metrics_text, DESIRED_METRIC)
    return round(value) if value is not None else None


def plan(desired: int, running: list[str], low: int, high: int,
         starting: Collection[str] = ()) -> tuple[int, list[str]]:
    """Executors to start and names to drain so that ``running`` (oldest first) becomes
    ``desired`` clamped to ``low..high``: the ``starting`` ones (not ready yet) first,
    then the newest."""
    want = min(high, max(low, desired))
    if want >= len(running):
        return want - len(running), []
    newest_first = list(reversed(running))
    order = [n for n in newest_first if n in starting] + [n for n in newest_first if n not in starting]
    return 0, order[:len(running) - want]


def overdue(started: Mapping[str, float], now: float, start_budget_s: float) -> list[str]:
    """The starting executors (name → start time, seconds) not ready within the budget at ``now``."""
    return [name for name, at in started.items() if now - at >= start_budget_s]


@dataclass(frozen=True)
class ScaleEvent:
    """One thing the autoscaler did or saw: ``kind`` start, ready, drain, exit or failed."""

    time: float
    kind: str
    name: str


@dataclass(frozen=True)
class Poll:
    """One read of the scheduler's metrics: the desired count and the token load of the
    planner's last interval (tokens/s) it was decided on."""

    time: float
    desired: int
    load_tokens_per_s: float


class LocalAutoscaler:
    """Keeps a ``meshserve.cli.launcher.Mesh``'s executors at the planner's count (module docstring).

    Args:
        mesh: a started mesh with metrics on (the scheduler's ``/metrics`` is read).
        low, high: the MIN..MAX range.
        poll_s: seconds between two reads.
        start_budget_s: an executor not ready this long after its start is failed
            and replaced (default: the mesh's ``start_budget_s``, else its
            ``startup_timeout_s``).
        clock: seconds (the events' times and the budget; tests pass a fake one).
    """

    def __init__(self, mesh, low: int, high: int, poll_s: float = 1.0, start_budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.mesh = mesh
        self.low, self.high = low, high
        self.poll_s = poll_s
        if start_budget_s is None:
            start_budget_s = mesh.config.start_budget_s or mesh.config.startup_timeout_s
        self.start_budget_s = start_budget_s
        self.clock = clock
        self.events: list[ScaleEvent] = []
        self.polls: deque[Poll] = deque(maxlen=MAX_POLLS)
        self.starting: dict[str, float] = {}  # executors started and not ready yet → start time
        self._watches: dict[str, asyncio.Task] = {}
        self._exiting: set[str] = set()

    def _record(self, kind: str, name: str) -> None:
        self.events.append(ScaleEvent(self.clock(), kind, name))

    async def _read(self) -> int | None:
        """The desired count now (None: unreadable), noted in ``polls``."""
        url = f"http://{self.mesh.metrics_addresses['scheduler']}/metrics"

        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - our own loopback endpoint
                return resp.read().decode()

        try:
            page = await asyncio.to_thread(get)
        except OSError:
            return None  # the scheduler is restarting or stopping: try again next poll
        desired = read_desired(page)
        if desired is not None:
            self.polls.append(Poll(self.clock(), desired, read_gauge(page, LOAD_METRIC) or 0.0))
        return desired

    async def _watch_ready(self, name: str, address: str) -> None:
        """Records ``name`` ready once it is SERVING. Watches as long as it may be starting:
        the start budget (``overdue`` stops the watch then), at least the mesh's
        ``startup_timeout_s``, so a budget above that timeout is not cut short."""
        timeout_s = max(self.start_budget_s, self.mesh.config.startup_timeout_s)
        try:
            await wait_serving(address, timeout_s, tls=self.mesh.tls("client"))
        except TimeoutError:
            return  # the start budget fails it
        finally:
            self._watches.pop(name, None)
        if self.starting.pop(name, None) is not None:
            self._record("ready", name)

    def _stop_watch(self, name: str) -> None:
        task = self._watches.pop(name, None)
        if task is not None:
            task.cancel()

    async def step(self) -> None:
        """One poll: fail executors over the start budget, read the desired count,
        start or drain, note exits."""
        for name in list(self._exiting):
            if self.mesh.exit_code(name) is not None:
                self._exiting.discard(name)
                self._record("exit", name)
        for name in overdue(self.starting, self.clock(), self.start_budget_s):
            del self.starting[name]
            self._stop_watch(name)
            self.mesh.abandon_executor(name)
            self._record("failed", name)
        desired = await self._read()
        if desired is None:
            return
        to_start, to_drain = plan(desired, self.mesh.executor_names, self.low, self.high, self.starting)
        for _ in range(to_start):
            name, address = self.mesh.add_executor()
            self.starting[name] = self.clock()
            self._record("start", name)
            self._watches[name] = asyncio.create_task(self._watch_ready(name, address))
        for name in to_drain:
            self.starting.pop(name, None)
            self._stop_watch(name)
            self.mesh.drain_executor(name)
            self._exiting.add(name)
            self._record("drain", name)

    async def run(self, stop: threading.Event | asyncio.Event) -> list[str]:
        """Polls until ``stop`` is set or a service fails; returns the failed services' names."""
        while not stop.is_set():
            await self.step()
            failed = self.mesh.exited()
            if failed:
                return failed
            await asyncio.sleep(self.poll_s)
        for name in list(self._watches):
            self._stop_watch(name)
        return []
