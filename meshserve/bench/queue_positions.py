"""The scheduler's CPU per polling round of queue feedback:
``python -m meshserve.bench.queue_positions [--sizes 1024,4096] [--policies fcfs,sjf]``.

Each waiting ``Admit`` call asks the admission core for its position and
estimated wait every 0.5 s (``scheduler.server``). For a queue of n requests
(one executor with no free blocks, so all of them wait) this runs one such
round: n calls of ``position`` and ``estimated_wait_s``, the core's clock moving
0.5 s / n between calls as the waiters' timers spread them, and prints the CPU
time (``time.process_time``) of the round and the number of sorts it took, as
one JSON line per policy and size. Run it with ``PYTHONPATH`` set to two source
trees in turn to compare them. No test times it (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
import time

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.queue_policy import QueuePolicy
from scheduler.registry import ExecutorState

POLL_INTERVAL_S = 0.5


class _Clock:
    def __init__(self) -> None:
        self.t = 1.0

    def __call__(self) -> float:
        return self.t


def one_round(policy: str, n: int) -> dict:
    """One polling round of ``n`` waiters under ``policy``; returns the figures."""
    clock = _Clock()
    core = AdmissionCore(SchedulerConfig(queue_policy=policy, max_queue_len=max(4096, n)), clock=clock)
    core.registry.add(ExecutorState("e", "addr", "m", 1000, 16, 4096))
    core.registry.report("e", 0, 0, 0, set())  # nothing free: every request waits
    for i in range(n):
        clock.t += 0.001
        core.submit(AdmissionRequest(f"r{i}", "t", 0, 100 + i % 50, 64, "m"))
    sorts = 0
    original = QueuePolicy.order

    def counted(self, queued, now):
        nonlocal sorts
        sorts += 1
        return original(self, queued, now)

    QueuePolicy.order = counted  # type: ignore[method-assign]
    try:
        started = time.process_time()
        for i in range(n):
            clock.t += POLL_INTERVAL_S / n
            core.estimated_wait_s(core.position(f"r{i}"))
        cpu_s = time.process_time() - started
    finally:
        QueuePolicy.order = original  # type: ignore[method-assign]
    return {"policy": policy, "waiters": n, "round_cpu_s": round(cpu_s, 4), "sorts": sorts,
            "poll_interval_s": POLL_INTERVAL_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="queue lengths, comma-separated")
    parser.add_argument("--policies", default="fcfs,sjf", help="queue policies, comma-separated")
    args = parser.parse_args()
    for policy in args.policies.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            print(json.dumps(one_round(policy, n)), flush=True)


if __name__ == "__main__":
    main()
