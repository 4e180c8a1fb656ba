"""CPU pinning of a local mesh: each executor on cores of its own, the other services beside.

A local mesh (``meshserve up``) gives each executor ``threads_per_executor`` torch
threads and keeps one core for the gateway, the scheduler, the kvstore and the
clients (``meshserve.cli.launcher.default_threads_per_executor``). Without pinning,
Linux still moves those services' threads onto an executor's cores, and an engine
thread that loses its core for a moment stalls the whole batch's step. Measured on
2 cores (``reports/vllm-cpu/``, runs 21 and 25, the default model at 32 concurrent
requests): the mesh ran at 0.91x the in-process engine with every process free to
move, and at 1.02x pinned, the executor on one core and the rest on the other.
vLLM's CPU backend binds its OpenMP threads to cores for the same reason
(``VLLM_CPU_OMP_THREADS_BIND``).

How it is applied: the launcher plans the cores (``plan_cpus``) and starts each
service with ``MESHSERVE_CPU_AFFINITY`` set to its list (``0-3,6`` as in
``taskset -c``); the service's process pins every thread it has to it first thing
(``apply_from_env``, run by ``meshserve.cli.main``), and every thread it starts
later inherits it. The variable works for a service started by hand too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

ENV = "MESHSERVE_CPU_AFFINITY"


@dataclass(frozen=True)
class CpuPlan:
    """Which cores each service of a local mesh may run on.

    Attributes:
        executor_cpus: one tuple of cores per executor slot, disjoint, each
            ``threads_per_executor`` long.
        service_cpus: the cores left for the gateway, scheduler and kvstore (at least one).
    """

    executor_cpus: tuple[tuple[int, ...], ...]
    service_cpus: tuple[int, ...]


def plan_cpus(allowed: Sequence[int], num_executors: int, threads_per_executor: int) -> CpuPlan | None:
    """Splits ``allowed`` cores: executor slot ``i`` gets the ``i``-th run of
    ``threads_per_executor`` cores (in ascending order), the services get the rest.

    Returns None when the cores do not fit every executor plus one core for the
    services (e.g. a launcher confined to one core): then nothing is pinned.

    Raises:
        ValueError: ``num_executors`` or ``threads_per_executor`` < 1.
    """
    if num_executors < 1 or threads_per_executor < 1:
        raise ValueError(f"need at least one executor and one thread, got {num_executors} x {threads_per_executor}")
    cpus = sorted(set(allowed))
    needed = num_executors * threads_per_executor
    if needed + 1 > len(cpus):
        return None
    slots = tuple(tuple(cpus[i * threads_per_executor:(i + 1) * threads_per_executor]) for i in range(num_executors))
    return CpuPlan(executor_cpus=slots, service_cpus=tuple(cpus[needed:]))


def unpinned_note(cpus: Sequence[int], slots: int, cores_each: int) -> str:
    """What ``up`` prints after ``cores:`` when the executors' cores (``slots`` x
    ``cores_each``) and one more for the other services do not fit ``cpus``, e.g.
    ``0-1, shared by every service (pinning needs 3: 2 executor(s) x 1 core(s) and one
    for the other services)``. Nothing is wrong then: Linux places the threads."""
    return (f"{format_cpu_list(cpus)}, shared by every service (pinning needs {slots * cores_each + 1}: "
            f"{slots} executor(s) x {cores_each} core(s) and one for the other services)")


def oversubscription(cpus: Sequence[int], slots: int, threads: int, ranks: int = 1) -> str:
    """A warning when the executors' torch threads (``slots`` executors x ``threads``
    x ``ranks``, the tensor- and pipeline-parallel processes of each) outnumber
    ``cpus``: every step of one then waits for cores the others hold. "" when they fit
    (the usual case: ``up``'s default threads leave each executor its share)."""
    total = slots * threads * ranks
    if total <= len(cpus):
        return ""
    shape = f"{slots} executor(s) x {threads} thread(s)" + (f" x {ranks} rank(s)" if ranks > 1 else "")
    return (f"{shape} = {total} torch threads on the {len(cpus)} core(s) this process may use "
            f"({format_cpu_list(cpus)}): each executor's steps will wait for cores the others hold; "
            "run fewer executors, threads or ranks")


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the ``taskset -c`` and ``/proc`` list syntax)."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def usable_cpus() -> list[int]:
    """The cores this process may run on (``taskset``, a container's cpuset), ascending;
    off Linux every core ``os.cpu_count`` reports."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str, num_cores: int | None = None) -> list[int]:
    """``"0-2,5"`` → ``[0, 1, 2, 5]``.

    Args:
        text: the list, as ``taskset -c`` writes it (ASCII digits, ``-`` ranges, ``,``).
        num_cores: the machine's cores (default ``os.cpu_count()``); a core at or past
            it is refused before any range is built.

    Raises:
        ValueError: empty, an item that is not a core number or a range, a range whose
            end is below its start, or a core this machine does not have.
    """
    limit = num_cores or os.cpu_count() or 1
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        first, sep, last = item.partition("-")
        bounds = [first, last] if sep else [first]
        if not all(b.isascii() and b.isdigit() for b in bounds):
            raise ValueError(f"{ENV}: {item!r} in {text!r} is not a core number or a range like 0-3")
        lo, hi = int(bounds[0]), int(bounds[-1])
        if hi < lo:
            raise ValueError(f"{ENV}: bad range {item!r} in {text!r}")
        if hi >= limit:
            raise ValueError(f"{ENV}: core {hi} in {text!r} does not exist (this machine has cores 0-{limit - 1})")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def pin_process(cpus: Sequence[int]) -> None:
    """Pins every thread of this process to ``cpus`` (threads started later inherit it).

    Raises:
        ValueError: a core of ``cpus`` is not one this process may use (``taskset``, a
            container's cpuset), or the platform has no ``sched_setaffinity`` (not Linux).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{ENV}: pinning to cores needs Linux (os.sched_setaffinity)")
    usable = set(usable_cpus())
    outside = sorted(set(cpus) - usable)
    if outside:
        raise ValueError(f"{ENV}={format_cpu_list(cpus)}: cores {format_cpu_list(outside)} are not ones this "
                         f"process may use ({format_cpu_list(sorted(usable))})")
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:
            raise ValueError(f"{ENV}={format_cpu_list(cpus)}: cannot pin to these cores: {exc}") from None


def apply_from_env(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """Pins this process to the cores ``MESHSERVE_CPU_AFFINITY`` names; returns them
    (None when the variable is unset or empty: nothing changes).

    Raises:
        ValueError: the variable does not parse, or names no core this process may use.
    """
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not text:
        return None
    cpus = parse_cpu_list(text)
    pin_process(cpus)
    return cpus
