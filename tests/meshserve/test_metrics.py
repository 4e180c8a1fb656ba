"""meshserve.metrics (bounded labels, the /metrics endpoint) and meshserve.device_metrics
(NVML through a fake module, the process-CPU fallback)."""

import urllib.request

import pytest
from prometheus_client import Counter

from meshserve.device_metrics import CpuUtilization, DeviceCollector, cuda_index
from meshserve.metrics import (OTHER, STOP_POLL_S, BoundedLabel, MetricsServer, new_registry, priority_classes,
                               snapshot)
from tests.support.metrics import fake_nvml, samples


def test_bounded_label_keeps_the_first_values_and_folds_the_rest():
    label = BoundedLabel(2)
    assert [label(v) for v in ("a", "b", "c", "a", 7, "b", "d")] == ["a", "b", OTHER, "a", OTHER, "b", OTHER]
    assert label.kept == {"a", "b"}
    zero = BoundedLabel(0)
    assert zero("a") == OTHER and zero.kept == frozenset()
    assert BoundedLabel(3)(OTHER) == OTHER and BoundedLabel(1)(5) == "5"
    with pytest.raises(ValueError):
        BoundedLabel(-1)


def test_reserved_values_keep_their_label_after_junk_filled_the_slots():
    """Found by a review: a caller sending priorities -1, -2, … took every priority
    label slot, and the real classes then landed in "other"."""
    label = BoundedLabel(3)
    label.reserve(priority_classes([0], [2]))  # a tenant's default 0 and ceiling 2: classes 0, 1, 2
    assert [label(v) for v in (-1, -2, -3, -4, 0, 1, 2, 3)] == ["-1", "-2", "-3", OTHER, "0", "1", "2", OTHER]
    assert label.kept == {"-1", "-2", "-3", "0", "1", "2"}


@pytest.mark.parametrize("defaults, ceilings, expected", [
    ([], [], [0]),                       # no tenants file: the default class only
    ([0], [5, None], [0, 1, 2, 3, 4, 5]),
    ([-2], [1], [-2, -1, 0, 1]),
    ([0], [100], [0, 100]),              # a span wider than the label slots: the configured values alone
])
def test_the_configured_priority_classes(defaults, ceilings, expected):
    assert priority_classes(defaults, ceilings) == expected


def test_metrics_server_serves_its_own_registry_and_stops():
    registry = new_registry("gateway")
    Counter("meshserve_test_events", "Events.", registry=registry).inc(3)
    other = new_registry("scheduler")  # a second registry in the same process does not collide
    Counter("meshserve_test_events", "Events.", registry=other).inc(5)
    server = MetricsServer(registry, 0)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
            got = samples(resp.read().decode())
        assert got[("meshserve_test_events_total", ())] == 3.0
        assert got[("meshserve_build_info", (("service", "gateway"), ("version", "0.1.0")))] == 1.0
        assert ("process_cpu_seconds_total", ()) in got
    finally:
        server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_an_ipv6_host_s_scrape_url_has_the_host_in_brackets():
    try:
        server = MetricsServer(new_registry("gateway"), 0, host="::1")
    except OSError as exc:  # a host without IPv6 loopback
        pytest.skip(f"no ::1 here: {exc}")
    try:
        assert server.address == f"[::1]:{server.port}" and server.url == f"http://[::1]:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
    finally:
        server.stop()


def test_the_metrics_thread_looks_for_a_stop_every_stop_poll_s(monkeypatch):
    """``stop`` waits until the serving thread sees it, which it looks for every
    ``STOP_POLL_S`` (0.05 s), not every 0.5 s (socketserver's and prometheus-client's
    default, which each service's stop waited out)."""
    from prometheus_client.exposition import ThreadingWSGIServer

    polls = []
    serve_forever = ThreadingWSGIServer.serve_forever

    def recorded(self, poll_interval=0.5):
        polls.append(poll_interval)
        serve_forever(self, poll_interval)

    monkeypatch.setattr(ThreadingWSGIServer, "serve_forever", recorded)
    server = MetricsServer(new_registry("gateway"), 0)
    try:
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
    finally:
        server.stop()
    assert polls == [STOP_POLL_S] == [0.05]


def test_snapshot_retries_a_read_that_raced_a_change():
    calls = []

    def read():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("dictionary changed size during iteration")
        return 42

    assert snapshot(read) == 42 and len(calls) == 3
    with pytest.raises(RuntimeError):
        snapshot(lambda: (_ for _ in ()).throw(RuntimeError("always")), attempts=2)


def collected(collector) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def test_nvml_path_reports_gpu_utilization_and_memory_of_the_device():
    nvml = fake_nvml()
    collector = DeviceCollector("cuda:1", nvml=nvml)
    assert collector.uses_nvml
    assert collected(collector) == {
        ("meshserve_gpu_utilization_ratio", (("gpu", "1"),)): 0.37,
        ("meshserve_gpu_memory_used_bytes", (("gpu", "1"),)): float(3 << 30),
        ("meshserve_gpu_memory_total_bytes", (("gpu", "1"),)): float(80 << 30),
    }
    assert nvml.calls == ["init", ("handle", 1), ("util", "h1"), ("mem", "h1")]
    collector.close()
    assert nvml.calls[-1] == "shutdown" and not collector.uses_nvml


def test_nvml_failure_and_cpu_devices_fall_back_to_process_cpu():
    ticks = iter([(0.0, 0.0), (2.0, 1.0)])  # (wall, cpu) seconds
    state = {}

    def wall():
        state["now"] = next(ticks)
        return state["now"][0]

    cpu = CpuUtilization(clock=wall, cpu_clock=lambda: state["now"][1], num_cpus=2)
    failing = fake_nvml(fail_init=True)
    collector = DeviceCollector("cuda", nvml=failing, cpu=cpu)
    assert not collector.uses_nvml and failing.calls == ["init"]
    assert collected(collector) == {("meshserve_process_cpu_utilization_ratio", ()): 0.25}  # 1 s / 2 s / 2 cores
    nvml = fake_nvml()
    assert not DeviceCollector("cpu", nvml=nvml).uses_nvml and nvml.calls == []  # NVML never touched on a CPU


def test_cpu_utilization_is_per_interval_and_keeps_the_last_value_without_time():
    wall, cpu = [10.0], [5.0]
    u = CpuUtilization(clock=lambda: wall[0], cpu_clock=lambda: cpu[0], num_cpus=4)
    wall[0], cpu[0] = 11.0, 7.0
    assert u.sample() == 0.5  # 2 CPU s / 1 s / 4 cores
    assert u.sample() == 0.5  # no time passed
    wall[0], cpu[0] = 13.0, 7.0
    assert u.sample() == 0.0


def test_cuda_index():
    assert [cuda_index(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3", "mps")] == [None, 0, 0, 3, None]
