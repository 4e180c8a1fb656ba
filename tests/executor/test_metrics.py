"""executor.metrics: every engine counter exported as is, busy fraction and MFU over
scrape intervals, the default peak FLOP/s."""

import pytest

from executor.engine.kv_connector import KVConnectorStats
from executor.engine.outputs import EngineStats
from executor.metrics import (DEFAULT_CPU_PEAK_FLOPS, DEFAULT_GPU_PEAK_FLOPS, EngineCollector, UtilizationWindow,
                              default_peak_flops, executor_registry)


def stats(**overrides) -> EngineStats:
    base = dict(num_blocks=100, num_free_blocks=75, num_running=3, num_waiting=2, num_steps=40,
                num_joined_running_batch=1, num_finished=9, num_aborted=1, num_preemptions=4, block_size=16,
                max_model_len=1024, prefix_cache_queried_tokens=400, prefix_cache_hit_tokens=100,
                num_cached_free_blocks=5, num_prompt_tokens=500, num_generation_tokens=300,
                kvstore_hit_tokens=32, kvstore_queried_tokens=128, forward_seconds=0.0, num_forward_tokens=0)
    base.update(overrides)
    return EngineStats(**base)


def collected(collector) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def test_utilization_window_busy_fraction_and_mfu():
    w = UtilizationWindow(num_params=1_000_000, peak_flops=1e9, now=10.0)
    # 0.5 s of forward in 2 s of wall time, 100 tokens: 2 * 1e6 * 100 / 0.5 = 4e8 FLOP/s = 40 % of 1e9
    assert w.update(12.0, 0.5, 100) == (0.25, pytest.approx(0.4))
    assert w.update(12.0, 0.5, 100) == (0.25, pytest.approx(0.4))  # no time passed: same values
    assert w.update(13.0, 0.5, 100) == (0.0, 0.0)  # idle second
    assert w.update(14.0, 2.5, 100_100) == (1.0, 1.0)  # clipped to [0, 1]
    with pytest.raises(ValueError):
        UtilizationWindow(1, 0.0, 0.0)


def test_engine_collector_exports_the_engine_counters_unchanged():
    now = [100.0]
    current = [stats()]
    connector = KVConnectorStats(fetches=4, fetched_blocks=6, bytes_in=6000, fetch_failures=1, fetch_seconds=0.2,
                                 published_blocks=3, bytes_out=3000)
    collector = EngineCollector(lambda: current[0], num_params=2_000, peak_flops=1e6, clock=lambda: now[0])
    now[0] = 104.0
    current[0] = stats(forward_seconds=1.0, num_forward_tokens=100, kvstore=connector)
    got = collected(collector)
    expected = {
        "meshserve_engine_requests_running": 3, "meshserve_engine_requests_waiting": 2,
        "meshserve_engine_prompt_tokens_total": 500, "meshserve_engine_generation_tokens_total": 300,
        "meshserve_engine_preemptions_total": 4, "meshserve_engine_steps_total": 40,
        "meshserve_engine_requests_finished_total": 9, "meshserve_engine_requests_aborted_total": 1,
        "meshserve_kv_cache_usage_ratio": 0.25,
        "meshserve_prefix_cache_queried_tokens_total": 400, "meshserve_prefix_cache_hit_tokens_total": 100,
        "meshserve_prefix_cache_hit_ratio": 0.25,
        "meshserve_executor_kvstore_queried_tokens_total": 128, "meshserve_executor_kvstore_hit_tokens_total": 32,
        "meshserve_executor_kvstore_hit_ratio": 0.25,
        "meshserve_executor_kvstore_fetch_seconds_count": 4, "meshserve_executor_kvstore_fetch_seconds_sum": 0.2,
        "meshserve_executor_kvstore_received_bytes_total": 6000, "meshserve_executor_kvstore_sent_bytes_total": 3000,
        "meshserve_executor_kvstore_fetch_failures_total": 1,
        "meshserve_engine_forward_seconds_total": 1.0, "meshserve_engine_forward_tokens_total": 100,
        "meshserve_engine_busy_ratio": 0.25,  # 1 s of forward in 4 s
        "meshserve_model_flops_utilization_ratio": 0.4,  # 2 * 2000 * 100 / 1 s / 1e6
        "meshserve_model_parameters": 2000, "meshserve_device_peak_flops": 1e6,
    }
    for name, value in expected.items():
        assert got[(name, ())] == pytest.approx(value), name
    assert {k[1][0][1]: v for k, v in got.items() if k[0] == "meshserve_kv_cache_blocks"} == {
        "total": 100, "free": 75, "cached_free": 5}


def test_without_connector_the_kvstore_figures_are_zero():
    got = collected(EngineCollector(lambda: stats(kvstore_hit_tokens=0, kvstore_queried_tokens=0), 1, 1.0))
    assert got[("meshserve_executor_kvstore_fetch_seconds_count", ())] == 0
    assert got[("meshserve_executor_kvstore_hit_ratio", ())] == 0.0
    assert got[("meshserve_executor_kvstore_received_bytes_total", ())] == 0


def test_default_peak_flops_by_device():
    assert default_peak_flops("cpu") == DEFAULT_CPU_PEAK_FLOPS == 1e12
    assert default_peak_flops("cuda:0", "NVIDIA H200") == 989e12
    assert default_peak_flops("cuda", "NVIDIA A100-SXM4-80GB") == 312e12
    assert default_peak_flops("cuda", "Some Future GPU") == DEFAULT_GPU_PEAK_FLOPS


def test_executor_registry_has_engine_device_and_process_metrics():
    registry = executor_registry(stats, 10, "cpu", peak_flops=5.0)
    names = {s.name for f in registry.collect() for s in f.samples}
    assert {"meshserve_engine_busy_ratio", "meshserve_process_cpu_utilization_ratio", "process_cpu_seconds_total",
            "meshserve_build_info"} <= names
    assert registry.get_sample_value("meshserve_device_peak_flops") == 5.0
