"""``python -m meshserve.bench.cpu_attention``: the one-layer comparison and the
many-layer pass over a cache that fills its memory budget (blocks scattered)."""

from __future__ import annotations

import json

import pytest

from executor.attention import cpu_kernel
from meshserve.bench import cpu_attention

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="the CPU attention kernel needs a C compiler")


def test_layers_fill_the_cache_budget_and_agree_with_sdpa(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert cpu_attention.main(["--batch", "3", "--context", "20", "--heads", "4", "--kv-heads", "2",
                               "--head-dim", "16", "--repeat", "2", "--layers", "3", "--kv-cache-memory", "1MiB",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # a block: K and V x 3 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 12 KiB; 1 MiB holds 85
    assert result["kernel_layers"]["num_blocks"] == 85
    assert result["kernel_layers"]["layers"] == 3
    assert result["kernel_layers"]["thread_cpu_ms"] > 0
    assert result["max_abs_diff"] < 1e-5
    assert "kernel over 3 layers from a 1MiB cache (85 blocks, scattered)" in capsys.readouterr().out


def test_a_budget_too_small_for_the_batch_is_refused():
    with pytest.raises(SystemExit, match="holds 2 blocks; the batch needs"):
        cpu_attention.run_layers(batch=4, context=40, heads=2, kv_heads=1, head_dim=16, dtype="float32", repeat=1,
                                 layers=2, kv_cache_memory=2 * 2 * 2 * 16 * 16 * 4)
