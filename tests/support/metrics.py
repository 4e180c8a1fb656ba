"""Metric helpers of the tests: a Prometheus text exposition as a dict, and a stand-in for
``pynvml`` (NVIDIA's NVML bindings) that records what ``DeviceCollector`` calls."""

from __future__ import annotations

import types

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) → value of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class FakeNVMLError(Exception):
    """The fake's ``NVMLError``."""


def fake_nvml(fail_init: bool = False) -> types.SimpleNamespace:
    """A stand-in for ``pynvml`` with the functions DeviceCollector calls; records the calls."""
    calls = []

    def init():
        calls.append("init")
        if fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def handle(index):
        calls.append(("handle", index))
        return f"h{index}"

    def util(h):
        calls.append(("util", h))
        return types.SimpleNamespace(gpu=37, memory=12)

    def mem(h):
        calls.append(("mem", h))
        return types.SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)

    return types.SimpleNamespace(NVMLError=FakeNVMLError, nvmlInit=init, nvmlDeviceGetHandleByIndex=handle,
                                 nvmlDeviceGetUtilizationRates=util, nvmlDeviceGetMemoryInfo=mem,
                                 nvmlShutdown=lambda: calls.append("shutdown"), calls=calls)
