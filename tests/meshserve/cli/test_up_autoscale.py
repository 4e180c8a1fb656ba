"""``meshserve up --autoscale``: the range, the plan, and a real mesh whose executor
processes follow the planner under a load ramp."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshserve.cli.autoscale import LOAD_METRIC, LocalAutoscaler, parse_range, plan, read_desired, read_gauge
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh import mesh_config
from meshserve.client import build_request, channel, generate
from meshserve.v1 import gateway_pb2_grpc
from tests.support.mesh_harness import wait_for_condition


def test_autoscale_range_and_plan():
    assert parse_range("1..4") == (1, 4) and parse_range("0..1") == (0, 1)
    for bad in ("3..1", "0..0", "1-4", "a..b"):
        with pytest.raises(ValueError, match="MIN..MAX"):
            parse_range(bad)
    running = ["executor-0", "executor-1", "executor-2"]
    assert plan(5, running, 1, 4) == (1, [])
    assert plan(1, running, 1, 4) == (0, ["executor-2", "executor-1"])  # newest (maybe still starting) first
    assert plan(0, running, 1, 4) == (0, ["executor-2", "executor-1"])  # never below MIN
    assert read_desired("# HELP x\nmeshserve_scheduler_desired_executors 3.0\n") == 3
    assert read_desired("meshserve_scheduler_executors 1.0\n") is None
    assert read_gauge("meshserve_scheduler_load_tokens_per_second 12.5\n", LOAD_METRIC) == 12.5


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeMesh:
    """What ``LocalAutoscaler.step`` uses of a ``Mesh``: `up --autoscale 0..1 --start-budget-s 600`
    (the services' own start-up timeout stays 300 s)."""

    def __init__(self, clock: FakeClock):
        self.config = SimpleNamespace(start_budget_s=600.0, startup_timeout_s=300.0)
        self.metrics_addresses = {"scheduler": "unused"}
        self.executor_names: list[str] = []
        self.killed: list[tuple[float, str]] = []
        self.clock = clock
        self.started = 0

    def tls(self, role):
        return None

    def add_executor(self) -> tuple[str, str]:
        name = f"executor-{self.started}"
        self.started += 1
        self.executor_names.append(name)
        return name, f"addr-{name}"

    def abandon_executor(self, name: str) -> None:
        self.executor_names.remove(name)
        self.killed.append((self.clock(), name))

    def exit_code(self, name: str):
        return None


async def test_an_executor_ready_after_the_startup_timeout_but_within_its_start_budget_is_ready(monkeypatch):
    """Start budget 600 s, the services' start-up timeout 300 s: an executor SERVING 400 s
    after its start is recorded ready at 400 s and never killed (the readiness watch lasts
    the start budget, not the 300 s timeout); one never SERVING is failed at 600 s, not
    at 599 s, and replaced at the same step."""
    clock = FakeClock()
    serving: set[str] = set()
    timeouts: list[float] = []

    async def wait_serving(address, timeout_s, service="", tls=None):
        timeouts.append(timeout_s)
        start = clock()
        while address not in serving:
            if clock() - start >= timeout_s:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0)

    async def settle():  # lets the readiness watches see the clock
        for _ in range(20):
            await asyncio.sleep(0)

    monkeypatch.setattr("meshserve.cli.autoscale.wait_serving", wait_serving)
    mesh = FakeMesh(clock)
    scaler = LocalAutoscaler(mesh, 0, 1, clock=clock)

    async def desired_one():
        return 1

    scaler._read = desired_one
    for t, becomes_serving in [(0.0, None), (350.0, None), (400.0, "addr-executor-0"), (650.0, None)]:
        clock.t = t
        if becomes_serving:
            serving.add(becomes_serving)
        await settle()
        await scaler.step()
        await settle()
    assert [(e.time, e.kind, e.name) for e in scaler.events] == [(0.0, "start", "executor-0"),
                                                                (400.0, "ready", "executor-0")]
    assert mesh.killed == [] and scaler.starting == {} and timeouts == [600.0]

    clock.t, mesh.executor_names = 1000.0, []  # executor-0 gone: executor-1 starts and never serves
    for t in (1000.0, 1599.0, 1600.0):
        clock.t = t
        await scaler.step()
        await settle()
    assert [(e.time, e.kind, e.name) for e in scaler.events[2:]] == [
        (1000.0, "start", "executor-1"), (1600.0, "failed", "executor-1"), (1600.0, "start", "executor-2")]
    assert mesh.killed == [(1600.0, "executor-1")] and list(scaler.starting) == ["executor-2"]
    scaler._stop_watch("executor-2")


def test_up_rejects_a_bad_range_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "meshserve.cli", "up", "--autoscale", "2..1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "MIN..MAX" in out.stderr


RAMP_S = 30.0  # arrivals rise linearly from 0.2 to 2.5 requests/s over this (the ramp's top)...
HOLD_MAX_S = 120.0  # ...then stay there until the second executor is ready (at most this long), then stop
LOW_S = 6.0  # the ramp's first seconds: at most 0.66 requests/s, under one executor's planned capacity
PLANNER = ["--planner-interval-s", "4", "--planner-season-s", "3600", "--executor-capacity-tokens-per-s", "40",
           "--scale-down-cooldown-s", "8", "--no-forecast"]


async def send_load(stub, calls: list, start: float, ready) -> float:
    """Open-loop arrivals (20 prompt + 8 output tokens each) following the ramp, then at its
    top until ``ready()``; returns the time of the last arrival."""
    sent = 0.0
    while (elapsed := time.monotonic() - start) < RAMP_S or not (ready() or elapsed >= RAMP_S + HOLD_MAX_S):
        rate = 0.2 + 2.3 * min(elapsed, RAMP_S) / RAMP_S
        prompt = [1000 + (i * 7919 + len(calls) * 31) % 40000 for i in range(20)]
        calls.append(asyncio.create_task(generate(stub, build_request(prompt, max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True), timeout=600)))
        sent += 1.0 / rate
        await asyncio.sleep(max(0.0, start + sent - time.monotonic()))
    return time.monotonic()


@pytest.mark.model
async def test_up_autoscale_adds_an_executor_as_the_load_rises_and_drains_it_after_the_peak(tmp_path: Path):
    """1..2 executors, planner interval 4 s, capacity 40 tokens/s at 80 % (32 planned), reactive
    only. Over the ramp's first 6 s (at most 3 requests of about 24 tokens in an interval:
    18 tokens/s) the planner wants 1; the load rises past 32 tokens/s about 15 s in, and only
    then, still before the ramp's top, is a second executor asked for (a request that waits a
    moment for its dispatch does not count as saturation, so the capacity is not measured
    down to the load). The load stays at the top until the second executor is ready (its
    cold start on this busy 2-core machine, up to 44 s measured, can exceed the ramp), then
    stops; the executor is drained after that (8 s cooldown) and exits cleanly (0); every
    request succeeds."""
    config = mesh_config(0, 1, "default", "float32", "64MiB", [], None, str(tmp_path / "logs"), metrics=True)
    config.scheduler_args += [*PLANNER, "--min-executors", "1", "--max-executors", "2"]
    mesh = Mesh(config)
    await mesh.start()
    stop = asyncio.Event()
    scaler = LocalAutoscaler(mesh, 1, 2, poll_s=0.5)
    scaling = asyncio.create_task(scaler.run(stop))
    try:
        async with channel(mesh.gateway_address) as ch:
            calls, start = [], time.monotonic()
            end = await send_load(gateway_pb2_grpc.GatewayStub(ch), calls, start,
                                  lambda: any(e.kind == "ready" for e in scaler.events))
            results = await asyncio.gather(*calls)
        assert all(len(r.token_ids) == 8 for r in results)
        try:
            await wait_for_condition(lambda: any(e.kind == "exit" for e in scaler.events), 120, "executor-1 drained")
        finally:
            print("autoscaler events:", [(e.kind, e.name, round(e.time - start, 1)) for e in scaler.events])
            print("polls (s, desired, load tokens/s):",
                  [(round(p.time - start, 1), p.desired, round(p.load_tokens_per_s, 1)) for p in scaler.polls])
        kinds = [(e.kind, e.name) for e in scaler.events]
        assert kinds == [("start", "executor-1"), ("ready", "executor-1"), ("drain", "executor-1"),
                         ("exit", "executor-1")]
        when = {e.kind: e.time for e in scaler.events}
        print(f"second executor: asked {when['start'] - start:.1f} s, ready {when['ready'] - start:.1f} s into "
              f"the ramp (top at {RAMP_S:.0f} s); load ended {end - start:.1f} s; drained "
              f"{when['drain'] - end:.1f} s after; {len(calls)} requests")
        low = [p for p in scaler.polls if start <= p.time < start + LOW_S]
        assert low and all(p.desired == 1 for p in low)  # the low load needs one executor: no scale-up at once
        asking = next(p for p in scaler.polls if p.desired == 2)
        assert asking.load_tokens_per_s > max(p.load_tokens_per_s for p in low)  # asked because the load rose
        assert start + LOW_S <= when["start"] < start + RAMP_S  # while the load rose, before its top
        assert when["ready"] <= end < when["drain"]  # ready under the peak load, drained after it
        assert mesh.exit_code("executor-1") == 0 and mesh.executor_names == ["executor-0"]
        assert mesh.exited() == []
    finally:
        stop.set()
        await scaling
        mesh.stop()


@pytest.mark.model
async def test_up_autoscale_from_zero_starts_an_executor_for_a_waiting_request(tmp_path: Path):
    """C44 for real (``up --autoscale 0..1``): the mesh starts with no executor; a request
    waits (it is not refused) and the planner asks for an executor. The autoscaler's clock
    then jumps past its start budget (300 s) while executor-0 still loads: executor-0 is
    declared failed, killed, and executor-1 started at the same poll. The request completes
    within executor-1's start + 10 s; one idle window (4 s) after its readiness executor-1
    drains and exits (0), back to zero; the killed executor is no failure of the mesh."""
    config = mesh_config(0, 0, "default", "float32", "64MiB", [], None, str(tmp_path / "logs"), metrics=True)
    config.scheduler_args += ["--planner-interval-s", "1", "--planner-season-s", "3600", "--scale-down-cooldown-s",
                              "4", "--no-forecast", "--min-executors", "0", "--max-executors", "1",
                              "--start-budget-s", "600"]
    mesh = Mesh(config)
    await mesh.start()
    assert mesh.executor_names == []
    skew = [0.0]
    stop = asyncio.Event()
    scaler = LocalAutoscaler(mesh, 0, 1, poll_s=0.5, start_budget_s=300, clock=lambda: time.monotonic() + skew[0])
    polls, poll_of = [0], {}  # the polls (steps) run; the poll each event was recorded at
    step, record = scaler.step, scaler._record

    async def counted_step():
        polls[0] += 1
        await step()

    def noted_record(kind, name):
        poll_of[(kind, name)] = polls[0]
        record(kind, name)

    scaler.step, scaler._record = counted_step, noted_record
    scaling = asyncio.create_task(scaler.run(stop))
    kinds = lambda: [(e.kind, e.name) for e in scaler.events]  # noqa: E731
    try:
        async with channel(mesh.gateway_address) as ch:
            call = asyncio.create_task(generate(gateway_pb2_grpc.GatewayStub(ch), build_request(
                [1000 + i for i in range(20)], max_tokens=8, temperature=0.0, ignore_eos=True), timeout=600))
            await wait_for_condition(lambda: ("start", "executor-0") in kinds(), 60, "an executor asked for")
            assert not call.done() and "executor-0" in scaler.starting  # waiting; executor-0 loading
            skew[0] = 301.0  # past the start budget
            await wait_for_condition(lambda: ("failed", "executor-0") in kinds(), 60, "executor-0 failed")
            result = await call
            done = scaler.clock()
        assert len(result.token_ids) == 8
        await wait_for_condition(lambda: ("exit", "executor-1") in kinds(), 120, "executor-1 drained")
        assert kinds() == [("start", "executor-0"), ("failed", "executor-0"), ("start", "executor-1"),
                           ("ready", "executor-1"), ("drain", "executor-1"), ("exit", "executor-1")]
        when = {(e.kind, e.name): e.time for e in scaler.events}
        start, ready = when[("start", "executor-1")], when[("ready", "executor-1")]
        assert poll_of[("failed", "executor-0")] == poll_of[("start", "executor-1")]  # replaced at the same poll
        print(f"from zero: executor-1 ready {ready - start:.1f} s after its start, the request done "
              f"{done - start:.1f} s after it, drained {when[('drain', 'executor-1')] - ready:.1f} s after ready")
        assert done - start <= (ready - start) + 10.0
        # the idle window (4 s) runs from readiness (the registration), not from the start (7-8 s
        # before it): counted from the start, the drain would come at once. The readiness watch
        # sees the registration ~1.2 s late on a quiet host (its reconnect backoff is capped at
        # 1 s, it polls every 0.2 s), later on a loaded one: 2.5 s of that are allowed
        assert when[("drain", "executor-1")] - ready >= 4.0 - 2.5, when
        assert mesh.exit_code("executor-1") == 0 and mesh.exit_code("executor-0") == -9
        assert mesh.executor_names == [] and mesh.exited() == []
    finally:
        stop.set()
        await scaling
        mesh.stop()
