"""``--compile/--no-compile`` (``executor.worker.compiled_decode``): on ``meshserve
executor`` it reaches the engine's config, off by default; on ``meshserve bench`` it
reaches the bench config, and the launched mesh's executors get it. Nothing is
started: the service and the bench are replaced by recorders."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from meshserve.bench.config import BenchConfig
from meshserve.bench.workload import WorkloadSpec
from meshserve.cli import app, processes, services
from tests.support.bench_launch import launched_executor_args

runner = CliRunner()


@pytest.fixture
def executor_configs(monkeypatch):
    configs = []
    monkeypatch.setattr(processes, "run_executor", lambda cfg, *args, **kwargs: configs.append(cfg))
    monkeypatch.setattr(services, "serve", lambda coro: None)
    return configs


@pytest.mark.parametrize("args,want", [([], False), (["--compile"], True), (["--no-compile"], False)])
def test_executor_compile_flag_reaches_the_engine_config(default_model_files, executor_configs, args, want):
    result = runner.invoke(app, ["executor", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0", *args])
    assert result.exit_code == 0, result.output
    [cfg] = executor_configs
    assert cfg.compile is want


def test_bench_compile_flag_reaches_the_bench_config(monkeypatch):
    import meshserve.bench

    seen = []
    monkeypatch.setattr(meshserve.bench, "main", lambda cfg, *args: seen.append(cfg) or 0)
    result = runner.invoke(app, ["bench", "--target", "engine", "--compile", "--num-requests", "1"])
    assert result.exit_code == 0, result.output
    assert [c.compile for c in seen] == [True]


def test_the_launched_mesh_passes_compile_to_its_executors(monkeypatch, tmp_path):
    cfg = BenchConfig(target="mesh", concurrency=1, workload=WorkloadSpec(num_requests=1), compile=True)
    assert "--compile" in launched_executor_args(monkeypatch, cfg, tmp_path)
