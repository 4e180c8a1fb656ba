"""The benchmark's run-queue wait of each system's busiest thread (``meshserve.bench.cpu_wait``):
read from a ``/proc`` tree written here (exact figures), and once from this process's own."""

from __future__ import annotations

import os

import pytest

from meshserve.bench.cpu_wait import CpuWait, CpuWaitProbe, process_tree, thread_times, warnings
from meshserve.bench import BenchConfig, WorkloadSpec
from meshserve.bench.loop import RequestResult
from meshserve.bench.report import build_report, format_table
from meshserve.bench.workload import make_workload


def _task(proc, pid: int, tid: int, on_cpu_ns: int, waiting_ns: int, parent: int = 1) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "schedstat").write_text(f"{on_cpu_ns} {waiting_ns} 17\n")
    (proc / str(pid) / "stat").write_text(f"{pid} (python -m x) S {parent} {pid} {pid} 0 -1\n")


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_busiest_thread_of_a_process_and_its_children_is_reported_with_its_wait(tmp_path):
    # executor 10 (main thread 10, engine thread 11) with a child rank 20; vllm 30 (one thread)
    _task(tmp_path, 10, 10, 1_000_000_000, 0)
    _task(tmp_path, 10, 11, 5_000_000_000, 1_000_000_000)
    _task(tmp_path, 20, 20, 0, 0, parent=10)
    _task(tmp_path, 21, 21, 0, 0, parent=20)  # a grandchild
    _task(tmp_path, 30, 30, 2_000_000_000, 0)
    (tmp_path / "self").mkdir()  # not a process: skipped
    assert process_tree(10, str(tmp_path)) == [10, 20, 21]
    assert process_tree(99, str(tmp_path)) == []
    assert thread_times([10], str(tmp_path)) == {(10, 10): (1.0, 0.0), (10, 11): (5.0, 1.0)}
    clock = _Clock()
    probe = CpuWaitProbe({"executor-0": 10, "vllm": 30, "gone": 99}, proc=str(tmp_path), clock=clock)
    probe.start()
    clock.now += 20.0
    _task(tmp_path, 10, 10, 1_500_000_000, 250_000_000)  # +0.5 s CPU
    _task(tmp_path, 10, 11, 16_000_000_000, 9_000_000_000)  # +11 s CPU, +8 s waiting: the busiest
    _task(tmp_path, 20, 20, 3_000_000_000, 500_000_000, parent=10)  # the child rank: +3 s
    _task(tmp_path, 30, 30, 21_000_000_000, 500_000_000)  # +19 s, +0.5 s
    _task(tmp_path, 30, 31, 1_000_000_000, 0)  # a thread started during the run: +1 s
    waits = probe.finish()
    assert waits == {"executor-0": CpuWait(11.0, 8.0, 20.0), "vllm": CpuWait(19.0, 0.5, 20.0)}
    assert waits["executor-0"].wait_fraction == 0.4
    report = {name: w.to_json() for name, w in waits.items()}
    assert report["vllm"] == {"busiest_thread_cpu_s": 19.0, "run_queue_wait_s": 0.5, "wait_fraction": 0.025}
    assert warnings(report) == ["executor-0's busiest thread waited for a CPU 40% of the run (8.0 s): other "
                                "processes shared its cores, so its figures are partly theirs"]


def test_the_terminal_table_shows_each_busiest_thread_and_warns_of_a_shared_core():
    spec = WorkloadSpec(num_requests=1, seed=5)
    workload = make_workload(spec, 49152, frozenset(range(17)))
    report = build_report(BenchConfig("engine", 1, spec), workload, [RequestResult("a", 10, 2, 0.0, (1.0, 2.0), 2.0)],
                          wall_s=2.0, target_facts={"dtype": "bfloat16"})
    report["cpu_wait"] = {"executor-0": {"busiest_thread_cpu_s": 11.0, "run_queue_wait_s": 8.0, "wait_fraction": 0.4}}
    lines = format_table(report).splitlines()
    assert lines[-2:] == [
        "busiest thread CPU / waiting  executor-0 11.0 / 8.0 s",
        "warning                       executor-0's busiest thread waited for a CPU 40% of the run (8.0 s): other "
        "processes shared its cores, so its figures are partly theirs"]
    report["cpu_wait"]["executor-0"].update(run_queue_wait_s=0.5, wait_fraction=0.025)
    assert format_table(report).splitlines()[-1] == "busiest thread CPU / waiting  executor-0 11.0 / 0.5 s"
    report["cpu_wait"] = {}
    assert "busiest" not in format_table(report)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"),
                    reason="no schedstat (not Linux, or a kernel without it)")
def test_this_process_s_own_counters_show_the_cpu_its_busiest_thread_spent():
    probe = CpuWaitProbe({"bench": os.getpid()})
    probe.start()
    total = sum(i * i for i in range(2_000_000))  # some CPU on this thread
    waits = probe.finish()
    assert total > 0
    assert set(waits) == {"bench"}
    assert waits["bench"].cpu_s > 0 and waits["bench"].wait_s >= 0
