"""The NVML path of ``meshserve.device_metrics`` against the real driver (skipped
without CUDA; run by tests/gpu_check.sh on a lent GPU). The fake-module tests in
tests/meshserve/test_metrics.py cover the same calls everywhere else."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_real_nvml_reports_the_device_memory_torch_holds():
    pytest.importorskip("pynvml")  # nvidia-ml-py, a project dependency
    from meshserve.device_metrics import DeviceCollector

    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")  # 256 MiB on the device
    collector = DeviceCollector("cuda:0")
    try:
        assert collector.uses_nvml
        samples = {s.name: s.value for f in collector.collect() for s in f.samples if s.labels == {"gpu": "0"}}
        total = torch.cuda.get_device_properties(0).total_memory
        assert set(samples) == {"meshserve_gpu_utilization_ratio", "meshserve_gpu_memory_used_bytes",
                                "meshserve_gpu_memory_total_bytes"}
        assert 0.0 <= samples["meshserve_gpu_utilization_ratio"] <= 1.0
        # NVML counts the whole device (every process, the CUDA context too); torch's
        # total excludes a little driver-reserved memory
        assert samples["meshserve_gpu_memory_used_bytes"] >= torch.cuda.memory_reserved(0) >= held.numel()
        assert total <= samples["meshserve_gpu_memory_total_bytes"] < total + (1 << 30)
    finally:
        collector.close()
        del held
