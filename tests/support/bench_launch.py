"""The executor flags the bench's mesh target would launch, without starting anything."""

from __future__ import annotations

import asyncio
from pathlib import Path

import meshserve.bench.targets as targets
from meshserve.bench.config import BenchConfig


def launched_executor_args(monkeypatch, config: BenchConfig, model_path: Path) -> list[str]:
    """``MeshTarget(config)._launch()`` with ``meshserve.cli.launcher.Mesh`` replaced by a
    recorder (``monkeypatch``: pytest's); the executors' command-line flags it was given."""
    started = []

    class Recorder:
        gateway_address = "127.0.0.1:1"

        def __init__(self, mesh_config):
            started.append(mesh_config)

        async def start(self):
            return None

    monkeypatch.setattr(targets, "Mesh", Recorder)
    target = targets.MeshTarget(config, model_path)
    asyncio.run(target._launch())
    target.log_dir.rmdir()
    return list(started[0].executor_args)
