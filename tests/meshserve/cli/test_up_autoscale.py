"""``meshserve up --autoscale``: the range, the plan, and a real mesh whose executor
processes follow the planner under a load ramp."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshserve.cli.autoscale import LocalAutoscaler, parse_range, plan, read_desired
from meshserve.cli.launcher import Mesh, free_port
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


def test_up_rejects_a_bad_range_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "meshserve.cli", "up", "--autoscale", "2..1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "MIN..MAX" in out.stderr


RAMP_S = 90.0  # arrivals rise linearly from 0.5 to 3 requests/s over this, then stop


@pytest.mark.model
async def test_up_autoscale_adds_an_executor_before_the_ramp_peak_and_drains_it_after(tmp_path: Path):
    """1..2 executors; capacity 45 tokens/s at 80 % (36): the reactive floor wants a second
    executor once two requests (about 24 tokens each) arrive within one 1 s interval, about
    20 s into the ramp. It must be ready (SERVING) before the ramp's peak, drained after
    it, and exit cleanly (0); every request succeeds (no caller sees an error)."""
    config = mesh_config(free_port(), 1, "default", "float32", "64MiB", [], None, str(tmp_path / "logs"), metrics=True)
    config.scheduler_args += ["--planner-interval-s", "1", "--planner-season-s", "3600", "--min-executors", "1",
                              "--max-executors", "2", "--executor-capacity-tokens-per-s", "45",
                              "--scale-down-cooldown-s", "3", "--no-forecast"]
    mesh = Mesh(config)
    await mesh.start()
    stop = asyncio.Event()
    scaler = LocalAutoscaler(mesh, 1, 2, poll_s=0.5)
    scaling = asyncio.create_task(scaler.run(stop))
    try:
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            calls, start, sent = [], time.monotonic(), 0.0
            while (elapsed := time.monotonic() - start) < RAMP_S:  # open loop: arrivals follow the ramp
                rate = 0.5 + 2.5 * elapsed / RAMP_S
                prompt = [1000 + (i * 7919 + len(calls) * 31) % 40000 for i in range(20)]
                calls.append(asyncio.create_task(generate(stub, build_request(prompt, max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True), timeout=600)))
                sent += 1.0 / rate
                await asyncio.sleep(max(0.0, start + sent - time.monotonic()))
            peak = time.monotonic()
            results = await asyncio.gather(*calls)
        assert all(len(r.token_ids) == 8 for r in results)
        try:
            await wait_for_condition(lambda: any(e.kind == "exit" for e in scaler.events), 300, "executor-1 drained")
        finally:
            print("autoscaler events:", [(e.kind, e.name, round(e.time - start, 1)) for e in scaler.events])
        kinds = [(e.kind, e.name) for e in scaler.events]
        assert kinds == [("start", "executor-1"), ("ready", "executor-1"), ("drain", "executor-1"),
                         ("exit", "executor-1")]
        when = {e.kind: e.time for e in scaler.events}
        print(f"second executor: asked {when['start'] - start:.1f} s, ready {when['ready'] - start:.1f} s into "
              f"the ramp; peak at {peak - start:.1f} s; drained {when['drain'] - peak:.1f} s after the peak")
        assert when["ready"] < peak < when["drain"]
        assert mesh.exit_code("executor-1") == 0 and mesh.executor_names == ["executor-0"]
        assert mesh.exited() == []
    finally:
        stop.set()
        await scaling
        mesh.stop()
