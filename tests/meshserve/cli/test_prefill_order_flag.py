"""``--prefill-order``: on ``meshserve executor`` it reaches the engine's batch config
("shortest" by default); on ``meshserve bench`` the bench config, and the launched mesh's
executors get it. Nothing is started: the service and the bench are replaced by recorders."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import meshserve.bench
from meshserve.bench.config import BenchConfig
from meshserve.bench.workload import WorkloadSpec
from meshserve.cli import app, processes, services
from tests.support.bench_launch import launched_executor_args

runner = CliRunner()


@pytest.mark.parametrize("args,want", [([], "shortest"), (["--prefill-order", "arrival"], "arrival")])
def test_executor_prefill_order_reaches_the_batch_config(default_model_files, monkeypatch, args, want):
    configs = []
    monkeypatch.setattr(processes, "run_executor", lambda cfg, *a, **kw: configs.append(cfg))
    monkeypatch.setattr(services, "serve", lambda coro: None)
    result = runner.invoke(app, ["executor", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0", *args])
    assert result.exit_code == 0, result.output
    assert [c.batch.prefill_order for c in configs] == [want]


def test_bench_prefill_order_reaches_the_bench_config_and_the_launched_executors(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(meshserve.bench, "main", lambda cfg, *args: seen.append(cfg) or 0)
    result = runner.invoke(app, ["bench", "--target", "mesh", "--prefill-order", "arrival", "--num-requests", "1"])
    assert result.exit_code == 0, result.output
    assert [c.prefill_order for c in seen] == ["arrival"]

    cfg = BenchConfig("mesh", 1, WorkloadSpec(num_requests=1), prefill_order="arrival")
    args = launched_executor_args(monkeypatch, cfg, tmp_path)
    assert args[args.index("--prefill-order") + 1] == "arrival"
