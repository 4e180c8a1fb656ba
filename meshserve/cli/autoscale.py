"""``meshserve up --autoscale MIN..MAX``: executor processes follow the scheduler's planner.

What KEDA or an HPA does in Kubernetes (deploy/k8s), on one machine: every
``poll_s`` the ``LocalAutoscaler`` reads ``meshserve_scheduler_desired_executors``
from the scheduler's ``/metrics`` (``scheduler.planner`` decides it: forecast
led by the cold start, reactive floor, one-at-a-time scale-down after a
cooldown), clamps it to MIN..MAX and

* starts ``executor-N`` processes while fewer run (``Mesh.add_executor``); each
  registers with the scheduler when loaded, reporting its cold start;
* sends SIGTERM to the newest while more run (``Mesh.drain_executor``; a
  starting one is the newest, so it goes first, case C44): the executor drains
  (nothing new is routed to it, what it runs finishes) and exits by itself.

``events`` records what happened when (start, ready, drain, exit; monotonic
seconds), for the tests and the closing report.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from dataclasses import dataclass

from meshserve.grpc_server import wait_serving

DESIRED_METRIC = "meshserve_scheduler_desired_executors"
_DESIRED_LINE = re.compile(rf"^{DESIRED_METRIC} ([0-9.eE+-]+)$", re.MULTILINE)


def parse_range(text: str) -> tuple[int, int]:
    """``"MIN..MAX"`` → (min, max).

    Raises:
        ValueError: not two integers with 0 <= MIN <= MAX and MAX >= 1.
    """
    match = re.fullmatch(r"\s*(\d+)\s*\.\.\s*(\d+)\s*", text)
    if not match or int(match[1]) > int(match[2]) or int(match[2]) < 1:
        raise ValueError(f"--autoscale must be MIN..MAX with 0 <= MIN <= MAX, MAX >= 1 (e.g. 1..4), got {text!r}")
    return int(match[1]), int(match[2])


def read_desired(metrics_text: str) -> int | None:
    """The desired executor count in a Prometheus text page, or None if absent."""
    match = _DESIRED_LINE.search(metrics_text)
    return round(float(match[1])) if match else None


def plan(desired: int, running: list[str], low: int, high: int) -> tuple[int, list[str]]:
    """Executors to start and names to drain (newest first) so that ``running`` (oldest
    first) becomes ``desired`` clamped to ``low..high``."""
    want = min(high, max(low, desired))
    if want >= len(running):
        return want - len(running), []
    return 0, list(reversed(running))[:len(running) - want]


@dataclass(frozen=True)
class ScaleEvent:
    """One thing the autoscaler did or saw: ``kind`` start, ready, drain or exit."""

    time: float
    kind: str
    name: str


class LocalAutoscaler:
    """Keeps a ``meshserve.cli.launcher.Mesh``'s executors at the planner's count (module docstring).

    Args:
        mesh: a started mesh with metrics on (the scheduler's ``/metrics`` is read).
        low, high: the MIN..MAX range.
        poll_s: seconds between two reads.
    """

    def __init__(self, mesh, low: int, high: int, poll_s: float = 1.0):
        self.mesh = mesh
        self.low, self.high = low, high
        self.poll_s = poll_s
        self.events: list[ScaleEvent] = []
        self._tasks: set[asyncio.Task] = set()
        self._exiting: set[str] = set()

    def _record(self, kind: str, name: str) -> None:
        self.events.append(ScaleEvent(time.monotonic(), kind, name))

    async def _read(self) -> int | None:
        url = f"http://{self.mesh.metrics_addresses['scheduler']}/metrics"

        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - our own loopback endpoint
                return resp.read().decode()

        try:
            return read_desired(await asyncio.to_thread(get))
        except OSError:
            return None  # the scheduler is restarting or stopping: try again next poll

    async def _watch_ready(self, name: str, address: str) -> None:
        await wait_serving(address, self.mesh.config.startup_timeout_s)
        self._record("ready", name)

    async def step(self) -> None:
        """One poll: read the desired count, start or drain, note exits."""
        for name in list(self._exiting):
            if self.mesh.exit_code(name) is not None:
                self._exiting.discard(name)
                self._record("exit", name)
        desired = await self._read()
        if desired is None:
            return
        to_start, to_drain = plan(desired, self.mesh.executor_names, self.low, self.high)
        for _ in range(to_start):
            name, address = self.mesh.add_executor()
            self._record("start", name)
            task = asyncio.create_task(self._watch_ready(name, address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for name in to_drain:
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
        for task in list(self._tasks):
            task.cancel()
        return []
