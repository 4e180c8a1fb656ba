"""``meshserve up --cpu-affinity`` (``MeshConfig.cpu_affinity``): the executor runs on
cores of its own and the other services on the cores left, every thread of each;
a second executor finds its slot taken until the first one has exited."""

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli import mesh as mesh_cli
from meshserve.cli.launcher import Mesh, default_threads_per_executor
from meshserve.cli.mesh_config import MeshConfig
from meshserve.client import build_request, channel, generate
from meshserve.cpu_affinity import format_cpu_list
from meshserve.v1 import gateway_pb2_grpc
from tests.support.mesh_harness import wait_for_condition


def _threads_cpus(pid: int) -> set[str]:
    """The distinct ``Cpus_allowed_list`` of every thread of process ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        out |= {line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")}
    return out


def test_up_pins_by_default_and_no_cpu_affinity_turns_it_off(monkeypatch):
    started = []
    monkeypatch.setattr(mesh_cli, "run_mesh", started.append)
    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    assert CliRunner().invoke(app, ["up", "--no-cpu-affinity"]).exit_code == 0
    assert [m.config.cpu_affinity for m in started] == [True, False]


def test_a_launcher_on_one_core_pins_nothing_and_says_what_the_services_share(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    mesh = Mesh(MeshConfig(cpu_affinity=True, threads_per_executor=1))
    assert mesh.cpu_plan is None
    assert mesh.cpu_note == ("0, shared by every service (pinning needs 2: 1 executor(s) x 1 core(s) and one for "
                             "the other services)")
    assert mesh.cpu_warning == ""  # one thread on one core: nothing is wrong


def test_two_executors_on_two_cores_share_them_with_no_warning(monkeypatch):
    """The README's ``up --executors 2`` on a 2-core machine: each executor gets one
    thread, so the threads fit the cores; only the other services have none to themselves."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mesh = Mesh(MeshConfig(executors=2, cpu_affinity=True))
    assert mesh.cpu_plan is None and mesh.cores_line() == (
        "0-1, shared by every service (pinning needs 3: 2 executor(s) x 1 core(s) and one for the other services)")
    assert mesh.cpu_warning == ""


def test_more_executor_threads_than_cores_is_a_warning_pinned_or_not(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    warning = ("3 executor(s) x 1 thread(s) = 3 torch threads on the 2 core(s) this process may use (0-1): each "
               "executor's steps will wait for cores the others hold; run fewer executors, threads or ranks")
    assert Mesh(MeshConfig(executors=3, cpu_affinity=True)).cpu_warning == warning
    assert Mesh(MeshConfig(executors=3, cpu_affinity=False)).cpu_warning == warning
    assert Mesh(MeshConfig(executors=1, autoscale=(1, 3), cpu_affinity=True)).cpu_warning == warning
    assert Mesh(MeshConfig(executor_args=["--num-threads", "2"], cpu_affinity=True)).cpu_warning == ""


def test_an_unpinned_mesh_of_parallel_executors_says_the_ranks_are_still_pinned(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mesh = Mesh(MeshConfig(cpu_affinity=True, threads_per_executor=1,
                           executor_args=["--tensor-parallel-size", "3"]))
    assert mesh.cpu_plan is None
    assert mesh.cpu_note == ("0-1, shared by every service (pinning needs 4: 1 executor(s) x 3 core(s) and one for "
                             "the other services); each executor still pins its 2 child rank(s) to shares of its "
                             "cores")
    assert mesh.cpu_warning == ("1 executor(s) x 1 thread(s) x 3 rank(s) = 3 torch threads on the 2 core(s) this "
                                "process may use (0-1): each executor's steps will wait for cores the others hold; "
                                "run fewer executors, threads or ranks")


@pytest.mark.parametrize("executors,warning", [
    (2, ""),
    (3, "warning: 3 executor(s) x 1 thread(s) = 3 torch threads on the 2 core(s) this process may use (0-1): each "
        "executor's steps will wait for cores the others hold; run fewer executors, threads or ranks\n")])
def test_up_warns_before_the_start_only_when_the_threads_outnumber_the_cores(monkeypatch, executors, warning):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})

    async def start(self):
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(Mesh, "start", start)
    result = CliRunner().invoke(app, ["up", "--executors", str(executors)])
    assert result.exit_code == 1
    assert result.stderr == f"{warning}error: not started in this test\n"


def test_the_executors_own_num_threads_is_what_is_planned(monkeypatch):
    """A mesh config's ``[executor] num-threads`` comes after the launcher's own flag and wins."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    mesh = Mesh(MeshConfig(cpu_affinity=True, executor_args=["--num-threads", "2"]))
    assert mesh.cpu_plan.executor_cpus == ((0, 1),) and mesh.cpu_plan.service_cpus == (2, 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # 2 threads do not fit 2 cores + 1
    assert Mesh(MeshConfig(cpu_affinity=True, executor_args=["--num-threads", "2"])).cpu_plan is None


@pytest.mark.parametrize("cpu_affinity", [True, False])
@pytest.mark.parametrize("flag", ["--num-threads", "--tensor-parallel-size", "--pipeline-parallel-size"])
def test_a_thread_or_rank_count_that_is_no_number_plans_nothing_and_is_left_to_the_executor(
        monkeypatch, cpu_affinity, flag):
    """Found by a review: ``--num-threads abc`` raised a ValueError from the plan; the
    executor's own flag check reports it (a usage error) when it starts."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    mesh = Mesh(MeshConfig(executors=3, cpu_affinity=cpu_affinity, executor_args=[flag, "abc"]))
    assert (mesh.cpu_plan, mesh.cpu_note, mesh.cpu_warning) == (None, "", "")


def test_default_threads_count_the_cores_the_launcher_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_threads_per_executor(1) == 1


def test_the_plan_has_a_slot_for_every_executor_autoscaling_may_start(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    mesh = Mesh(MeshConfig(executors=1, autoscale=(1, 3), threads_per_executor=2, cpu_affinity=True))
    assert mesh.cpu_plan.executor_cpus == ((0, 1), (2, 3), (4, 5)) and mesh.cpu_plan.service_cpus == (6, 7)
    assert Mesh(MeshConfig(executors=1, autoscale=(1, 4), threads_per_executor=2, cpu_affinity=True)).cpu_plan is None


def test_an_executors_parallel_ranks_each_get_its_threads_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    mesh = Mesh(MeshConfig(executors=2, threads_per_executor=1, cpu_affinity=True,
                           executor_args=["--tensor-parallel-size", "3"]))
    assert mesh.cpu_plan.executor_cpus == ((0, 1, 2), (3, 4, 5)) and mesh.cpu_plan.service_cpus == (6, 7)
    tp_pp = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    assert Mesh(MeshConfig(threads_per_executor=2, cpu_affinity=True, executor_args=tp_pp)).cpu_plan is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(10)))  # 4 ranks x 2 threads, and 2 left
    pp = Mesh(MeshConfig(threads_per_executor=2, cpu_affinity=True, executor_args=tp_pp))
    assert pp.cpu_plan.executor_cpus == (tuple(range(8)),) and pp.cpu_plan.service_cpus == (8, 9)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # TP=3 on 2 cores: as before, unpinned
    assert Mesh(MeshConfig(threads_per_executor=1, cpu_affinity=True,
                           executor_args=["--tensor-parallel-size", "3"])).cpu_plan is None


@pytest.mark.model
async def test_the_executor_has_its_own_core_and_the_services_the_rest(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    mesh = Mesh(MeshConfig(port=0, executor_args=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                           threads_per_executor=1, log_dir=tmp_path, cpu_affinity=True))
    await mesh.start()
    try:
        executor_core, services = str(allowed[0]), format_cpu_list(allowed[1:])
        assert mesh.cpus == {"scheduler": services, "executor-0": executor_core, "gateway": services}
        for name, proc in mesh.procs:
            assert _threads_cpus(proc.pid) == {mesh.cpus[name]}, name
        async with channel(mesh.gateway_address) as ch:
            out = await generate(gateway_pb2_grpc.GatewayStub(ch), build_request(
                [1000 + i for i in range(12)], max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out.token_ids) == 4
        # the one slot is held while executor-0 runs (a second one would get every core) ...
        assert mesh._executor_cpus("executor-x") == tuple(allowed)
        mesh.drain_executor("executor-0")
        await wait_for_condition(lambda: mesh.exit_code("executor-0") is not None, 60, "executor-0 exited")
        assert mesh.exit_code("executor-0") == 0
        assert mesh._executor_cpus("executor-y") == (allowed[0],)  # ... and free once it has exited
    finally:
        mesh.stop()


def test_a_launcher_off_linux_pins_nothing(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    mesh = Mesh(MeshConfig(cpu_affinity=True, threads_per_executor=1))
    assert mesh.cpu_plan is None and mesh.cpu_note == "not pinned (pinning needs Linux)"
