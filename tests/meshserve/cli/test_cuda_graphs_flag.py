"""``--cuda-graphs/--no-cuda-graphs`` on ``meshserve executor``: the flag's value (None
when not given) reaches ``EngineConfig.cuda_graphs`` (``executor.worker.cuda_graphs``).

Here and not in ``tests/executor/test_cuda_graphs.py``: ``tests/gpu_check.sh`` runs that
module on a GPU image without the CLI's dependencies (opentelemetry, cryptography,
redis…), which ``meshserve.cli.processes`` imports."""

from __future__ import annotations

import pytest

from meshserve.cli.processes import engine_config


@pytest.mark.parametrize("value", [True, False, None])
def test_cuda_graphs_flag_reaches_the_engine_config(value):
    assert engine_config("default", "auto", "64MiB", 16, 8, 64, False, None, None,
                         cuda_graphs=value).cuda_graphs is value
