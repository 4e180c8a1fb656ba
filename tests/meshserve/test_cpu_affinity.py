"""CPU pinning of a local mesh (``meshserve.cpu_affinity``): the plan, the list syntax,
and a process pinning every thread it has from ``MESHSERVE_CPU_AFFINITY``."""

import os
import subprocess
import sys

import pytest

from meshserve.cpu_affinity import CpuPlan, apply_from_env, format_cpu_list, parse_cpu_list, pin_process, plan_cpus


@pytest.mark.parametrize("allowed, executors, threads, plan", [
    ([0, 1], 1, 1, CpuPlan(((0,),), (1,))),
    ([3, 1, 2, 0], 1, 3, CpuPlan(((0, 1, 2),), (3,))),
    ([0, 1, 2, 3, 4], 2, 2, CpuPlan(((0, 1), (2, 3)), (4,))),
    ([4, 5, 6, 7, 12, 13], 2, 2, CpuPlan(((4, 5), (6, 7)), (12, 13))),
    ([2, 2, 5], 1, 1, CpuPlan(((2,),), (5,))),
])
def test_executors_get_consecutive_runs_and_the_services_the_rest(allowed, executors, threads, plan):
    assert plan_cpus(allowed, executors, threads) == plan


@pytest.mark.parametrize("allowed, executors, threads", [([0], 1, 1), ([0, 1], 1, 2), ([0, 1, 2, 3], 2, 2), ([], 1, 1)])
def test_no_plan_when_the_executors_leave_no_core_for_the_services(allowed, executors, threads):
    assert plan_cpus(allowed, executors, threads) is None


@pytest.mark.parametrize("executors, threads", [(0, 1), (1, 0)])
def test_a_plan_needs_an_executor_and_a_thread(executors, threads):
    with pytest.raises(ValueError, match="at least one executor"):
        plan_cpus([0, 1, 2], executors, threads)


@pytest.mark.parametrize("text, cpus", [("0", [0]), ("0-2,5", [0, 1, 2, 5]), (" 3 , 1-2 ", [1, 2, 3]),
                                        ("4-4,4", [4])])
def test_cpu_lists_parse_and_format_as_taskset_writes_them(text, cpus):
    assert parse_cpu_list(text, num_cores=8) == cpus
    assert parse_cpu_list(format_cpu_list(cpus), num_cores=8) == cpus
    assert format_cpu_list([5, 0, 2, 1]) == "0-2,5"


@pytest.mark.parametrize("text, message", [("", "not a core number"), ("a", "not a core number"),
                                           ("3-1", "bad range"), ("1,,2", "not a core number"),
                                           ("-1", "not a core number"), ("+1", "not a core number"),
                                           ("\u0660", "not a core number"), ("1-", "not a core number"),
                                           ("0,9", r"core 9 in '0,9' does not exist \(this machine has cores 0-7\)"),
                                           ("0-99999999999", "core 99999999999 in '0-99999999999' does not exist")])
def test_a_bad_cpu_list_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text, num_cores=8)


def test_a_core_outside_the_process_cores_is_refused_not_dropped(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: calls.append(cpus))
    with pytest.raises(ValueError, match=r"cores 1,3 are not ones this process may use \(0,2\)"):
        pin_process([0, 1, 3])
    assert calls == []


def test_an_unset_variable_changes_nothing():
    before = os.sched_getaffinity(0)
    assert apply_from_env({}) is None and apply_from_env({"MESHSERVE_CPU_AFFINITY": " "}) is None
    assert os.sched_getaffinity(0) == before


_CHILD = """
import os, threading, time
from meshserve.cpu_affinity import apply_from_env
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(5)), daemon=True).start()
started.wait()
print(apply_from_env())
for tid in sorted(os.listdir("/proc/self/task")):
    print(tid, sorted(os.sched_getaffinity(int(tid))))
"""


def test_every_thread_of_the_process_is_pinned_also_one_started_before():
    core = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, "MESHSERVE_CPU_AFFINITY": str(core)},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == f"[{core}]"
    threads = [line.split(" ", 1)[1] for line in out[1:] if line]
    assert threads == [f"[{core}]"] * 2  # the main thread and the one started before


def test_a_core_the_process_may_not_use_is_a_usage_error_of_the_command():
    missing = os.cpu_count()
    result = subprocess.run([sys.executable, "-m", "meshserve.cli", "--help"], capture_output=True, text=True,
                            env={**os.environ, "MESHSERVE_CPU_AFFINITY": f"0,{missing}"})
    assert result.returncode == 2
    assert result.stderr == (f"error: MESHSERVE_CPU_AFFINITY: core {missing} in '0,{missing}' does not exist "
                             f"(this machine has cores 0-{missing - 1})\n")
    bad = subprocess.run([sys.executable, "-m", "meshserve.cli", "--help"], capture_output=True, text=True,
                         env={**os.environ, "MESHSERVE_CPU_AFFINITY": "two"})
    assert bad.returncode == 2 and "'two' in 'two' is not a core number" in bad.stderr


def test_pinning_off_linux_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(ValueError, match="pinning to cores needs Linux"):
        apply_from_env({"MESHSERVE_CPU_AFFINITY": "0"})
