"""The step profile's split of profiler events into parts (no model)."""

import time
from dataclasses import dataclass

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
    assert parts["attention"] >= 2000  # the kernel's sleep counts as attention (its share of "model python": below)
    assert sum(parts.values()) == pytest.approx(max(wall_us, sum(v for k, v in parts.items() if k != "python")))


@dataclass
class _Event:
    """The fields of a profiler event that ``breakdown`` reads (microseconds)."""

    name: str
    cpu_time_total: float
    self_cpu_time_total: float
    cpu_parent: "_Event | None" = None


def test_a_kernel_range_inside_the_model_counts_as_its_part_not_as_model_python():
    """Exact split of a hand-made event tree: no profiler, no clock (a loaded host cannot move it)."""
    model = _Event("ms.model", cpu_time_total=10_000, self_cpu_time_total=0)
    kernel = _Event("ms.attention_kernel", cpu_time_total=4_000, self_cpu_time_total=4_000, cpu_parent=model)
    gemm_kernel = _Event("ms.gemm_kernel", cpu_time_total=1_500, self_cpu_time_total=1_200, cpu_parent=model)
    fused_kernel = _Event("ms.fused_kernel", cpu_time_total=800, self_cpu_time_total=800, cpu_parent=model)
    sampling = _Event("ms.sampling", cpu_time_total=700, self_cpu_time_total=100)
    events = [
        model, kernel, gemm_kernel, fused_kernel, sampling,
        _Event("aten::mm", 1_000, 1_000, cpu_parent=model),
        _Event("aten::index_select", 300, 300, cpu_parent=model),
        _Event("aten::add", 200, 200, cpu_parent=model),
        _Event("aten::copy_", 300, 300, cpu_parent=gemm_kernel),  # an op inside the GEMM kernel's range
        _Event("aten::argmax", 600, 600, cpu_parent=sampling),
        _Event("aten::mul", 400, 400),  # in no range: part of "python", the wall time's rest
    ]
    parts = breakdown(events, wall_us=12_000)
    assert parts["gemm"] == 1_000 + 300 + (1_500 - 300)  # aten::mm, the op inside the kernel, the kernel's own time
    assert parts["attention"] == 300 + 4_000  # index_select and the attention kernel's range
    assert parts["norm/elementwise"] == 200 + 800  # aten::add and the fused kernels' range
    # The model's range less the three kernel ranges, less the ops directly in it: 10,000 - 4,000 - 1,500 - 800
    # - 1,500.
    assert parts["model python"] == 2_200
    assert parts["sampling"] == 600 + (700 - 600)
    assert parts["scheduling"] == 0 and parts["metadata"] == 0
    assert parts["python"] == 12_000 - (2_500 + 4_300 + 1_000 + 2_200 + 700)


def test_every_kernel_entry_point_the_profile_wraps_exists_and_records_its_range(monkeypatch):
    """A renamed kernel call must not drop out of its part into "model python" unseen (the prefill kernel,
    left unlisted, once put its 300 ms of a 1,024-token step there): every listed entry point exists, and
    a wrapped call runs inside its range."""
    import meshserve.bench.step_profile as step_profile

    entry_points = step_profile.kernel_entry_points()
    assert len(entry_points) == len(step_profile.KERNEL_CALLS)  # every listed one exists
    for owner, name, label in entry_points:
        assert callable(getattr(owner, name)), (owner, name)
        assert step_profile._REGIONS[label] != "model", label
        # each call replaced by a plain function (the originals come back after the test)
        monkeypatch.setattr(owner, name, lambda *args, _name=name, **kwargs: _name)
    step_profile.instrument_kernels()
    for owner, name, label in entry_points:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert getattr(owner, name)() == name
        assert [ev.name for ev in prof.events()] == [label], (owner, name)
