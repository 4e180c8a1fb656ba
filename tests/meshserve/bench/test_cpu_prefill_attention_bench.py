"""``python -m meshserve.bench.cpu_prefill_attention``: the three prefill paths agree and are timed."""

from __future__ import annotations

import json

import pytest

from executor.attention import cpu_prefill_kernel
from meshserve.bench import cpu_prefill_attention

pytestmark = pytest.mark.skipif(cpu_prefill_kernel.load() is None,
                                reason="the prefill kernel needs AVX512-BF16 and a C compiler")


def test_the_paths_agree_within_bfloat16_rounding_and_are_timed(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert cpu_prefill_attention.main(["--prompt-lens", "40", "70", "--layers", "2", "--repeat", "2",
                                       "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["prompt_len"] for r in results] == [40, 70]
    for r in results:
        assert r["layers"] == 2 and set(r["ms"]) == {"prefill_kernel", "token_rows", "sdpa"}
        assert all(ms > 0 for ms in r["ms"].values())
        assert r["max_abs_diff"]["token_rows"] < 0.05 and r["max_abs_diff"]["sdpa"] < 0.05
    assert "prompt    70 x 2 layers" in capsys.readouterr().out
