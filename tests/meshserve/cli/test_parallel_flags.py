"""``--tensor-parallel-size`` and ``--pipeline-parallel-size`` on ``meshserve executor``
and ``meshserve up``: a layout the default model cannot be split into is a usage
error before anything loads (exit 2, the sizes it allows named), and ``up`` hands
the two flags to its executors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli.mesh import mesh_config, parallel_args

runner = CliRunner()


def _text(output: str) -> str:
    return " ".join(output.replace("│", " ").split())  # unwrap typer's error box


@pytest.mark.parametrize("command", [["executor", "--scheduler", "127.0.0.1:1", "--insecure"], ["up"]],
                         ids=["executor", "up"])
@pytest.mark.parametrize("args,message", [
    (["--tensor-parallel-size", "2"], "tensor-parallel size 2 does not split this model (9 attention heads, 3 KV "
                                      "heads, intermediate_size 1536); it must divide the attention heads and the "
                                      "intermediate size, and divide or be a multiple of the KV heads: one of 1, 3"),
    (["--pipeline-parallel-size", "31"], "pipeline-parallel size 31 exceeds the model's 30 layers"),
    (["--tensor-parallel-size", "0"], "should be greater than or equal to 1"),
])
def test_a_layout_the_model_cannot_take_is_a_usage_error(default_model_files, command, args, message):
    result = runner.invoke(app, [*command, *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in _text(result.output)


def test_up_hands_the_parallel_sizes_to_its_executors():
    assert parallel_args(1, 1) == []
    assert parallel_args(3, 2) == ["--tensor-parallel-size", "3", "--pipeline-parallel-size", "2"]
    config = mesh_config(50061, 1, "default", "float32", "1GiB", parallel_args(3, 1), None, None)
    assert config.executor_args == ["--dtype", "float32", "--kv-cache-memory", "1GiB", "--tensor-parallel-size", "3"]
