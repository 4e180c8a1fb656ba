"""How long the system under test waited for a CPU during a measured run (Linux).

A benchmark on a shared machine measures the other processes too: an engine thread
that sits on the run queue while someone else's job holds its core runs its steps
later, and nothing in the latency figures says so. The kernel counts it per thread
(``/proc/PID/task/TID/schedstat``: nanoseconds on a CPU, nanoseconds runnable but
waiting for one; ``Documentation/scheduler/sched-stats.rst``), so ``meshserve bench``
reads it for the processes that run each system's engine (the in-process engine's
own process, a launched mesh's executors, vLLM's script and its children) and
reports, for the thread of each that ran the most over the run (the engine's step
loop), its CPU seconds and its seconds waiting for a core. Measured: the mesh's
executor pinned to a core that a test run shared waited 43% of a 20 s window, and
the mesh ran at 0.65-0.69x the engine; on a quiet core it waited 3.5% and ran at
0.97-1.02x (``reports/vllm-cpu/`` run 57).

Off Linux, or where the counters are not readable, nothing is reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping

PROC = "/proc"
WAIT_WARNING = 0.05
"""Share of the run a system's busiest thread waited for a core above which the summary says so."""


def process_tree(pid: int, proc: str = PROC) -> list[int]:
    """``pid`` and its descendants, ``pid`` first; [] when ``pid`` is gone. Read from each
    process's parent in ``/proc/*/stat`` (``/proc/PID/task/TID/children`` needs a kernel
    option many kernels lack)."""
    if not os.path.isdir(f"{proc}/{pid}"):
        return []
    children: dict[int, list[int]] = {}
    for entry in _listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as f:
                stat = f.read()
            parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the name in parentheses may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(sorted(c for c in children.get(tree[i], ()) if c not in tree))
        i += 1
    return tree


def thread_times(pids: list[int], proc: str = PROC) -> dict[tuple[int, int], tuple[float, float]]:
    """``(pid, tid)`` → ``(seconds on a CPU, seconds waiting for one)`` of every thread of ``pids``
    whose ``schedstat`` is readable."""
    out = {}
    for pid in pids:
        for task in _listdir(f"{proc}/{pid}/task"):
            try:
                with open(f"{proc}/{pid}/task/{task}/schedstat") as f:
                    on_cpu, waiting = f.read().split()[:2]
            except (OSError, ValueError):
                continue
            out[(pid, int(task))] = (int(on_cpu) / 1e9, int(waiting) / 1e9)
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclass(frozen=True)
class CpuWait:
    """The busiest thread of one system over a run.

    Attributes:
        cpu_s: its seconds on a CPU during the run.
        wait_s: its seconds runnable but waiting for a CPU.
        wall_s: the run's wall-clock seconds.
    """

    cpu_s: float
    wait_s: float
    wall_s: float

    @property
    def wait_fraction(self) -> float:
        """``wait_s`` over ``wall_s`` (0 for an empty run)."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"busiest_thread_cpu_s": round(self.cpu_s, 3), "run_queue_wait_s": round(self.wait_s, 3),
                "wait_fraction": round(self.wait_fraction, 4)}


class CpuWaitProbe:
    """Reads the threads of named processes (and their children) before and after a run.

    Args:
        processes: a name for each system process (``{"executor-0": pid}``).
        proc: the ``/proc`` folder (tests give another).
        clock: the wall clock (``time.monotonic``).
    """

    def __init__(self, processes: Mapping[str, int], proc: str = PROC, clock=time.monotonic):
        self.processes = dict(processes)
        self.proc = proc
        self.clock = clock
        self._before: dict[str, dict[tuple[int, int], tuple[float, float]]] = {}
        self._start = 0.0

    def start(self) -> None:
        self._start = self.clock()
        self._before = {name: thread_times(process_tree(pid, self.proc), self.proc)
                        for name, pid in self.processes.items()}

    def finish(self) -> dict[str, CpuWait]:
        """Each process's busiest thread over the run (the most CPU time gained since
        ``start``); processes with no readable thread are left out."""
        wall = self.clock() - self._start
        out = {}
        for name, pid in self.processes.items():
            before = self._before.get(name, {})
            after = thread_times(process_tree(pid, self.proc), self.proc)
            deltas = [(cpu - before.get(key, (0.0, 0.0))[0], wait - before.get(key, (0.0, 0.0))[1])
                      for key, (cpu, wait) in after.items()]
            if deltas:
                cpu, wait = max(deltas)
                out[name] = CpuWait(cpu, wait, wall)
        return out


def warnings(report: Mapping[str, Mapping]) -> list[str]:
    """Summary lines for the systems of one report's ``cpu_wait`` whose busiest thread
    waited for a core ``WAIT_WARNING`` or more of the run."""
    return [f"{name}'s busiest thread waited for a CPU {100 * w['wait_fraction']:.0f}% of the run "
            f"({w['run_queue_wait_s']:.1f} s): other processes shared its cores, so its figures are partly theirs"
            for name, w in report.items() if w["wait_fraction"] >= WAIT_WARNING]
