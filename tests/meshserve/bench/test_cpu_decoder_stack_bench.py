"""``python -m meshserve.bench.cpu_decoder_stack``: the driver and the eager layers give
bitwise equal logits and are both timed."""

from __future__ import annotations

import json

import pytest

from executor.models import cpu_decoder_stack, cpu_gemm
from meshserve.bench import cpu_decoder_stack as bench
from tests.support.tiny_models import save_tiny

pytestmark = pytest.mark.skipif(cpu_decoder_stack.load() is None, reason="no C compiler on this host")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_ways_give_the_same_logits_and_are_timed(tmp_path, capsys, dtype):
    if (cpu_gemm.load_bf16() if dtype == "bfloat16" else cpu_gemm.load()) is None:
        pytest.skip(f"no {dtype} GEMM kernel on this CPU (bfloat16 needs AVX512-BF16): no driver")
    save_tiny("llama-bias", tmp_path / "model")
    out = tmp_path / "stack.json"
    assert bench.main(["--model", str(tmp_path / "model"), "--batch", "1", "3", "--context", "20", "--repeat", "2",
                       "--dtype", dtype, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == dtype and [row["batch"] for row in report["batches"]] == [1, 3]
    for row in report["batches"]:
        assert row["logits_bitwise_equal"] is True
        assert all(ms > 0 for side in ("eager", "driver") for ms in row["median_ms"][side].values())
    assert "batch   3  eager" in capsys.readouterr().out
