"""The step profile's split of profiler events into parts (no model)."""

import time

import pytest
import torch

from meshserve.bench.step_profile import PARTS, breakdown


def test_ops_count_in_the_part_of_their_range_and_the_parts_sum_to_the_wall_time():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        with torch.profiler.record_function("ms.prepare_inputs"):
            torch.arange(1000).sum()
        with torch.profiler.record_function("ms.model"):
            torch.mm(a, b)
            torch.add(a, b)
            torch.index_select(a, 0, torch.tensor([1, 2]))
            with torch.profiler.record_function("ms.attention_kernel"):  # C code inside the model
                time.sleep(0.002)
        with torch.profiler.record_function("ms.sampling"):
            a.argmax(dim=-1)
        torch.mul(a, 2)  # in no range: "python"
        wall_us = (time.perf_counter() - start) * 1e6
    parts = breakdown(prof.events(), wall_us)
    assert set(parts) <= set(PARTS)
    for part in ("gemm", "attention", "norm/elementwise", "metadata", "sampling"):
        assert parts[part] > 0, part
    assert parts["scheduling"] == 0
    assert parts["attention"] >= 2000 and parts["model python"] < 2000  # the kernel's time is attention
    assert sum(parts.values()) == pytest.approx(max(wall_us, sum(v for k, v in parts.items() if k != "python")))
