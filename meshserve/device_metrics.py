"""Device utilization as Prometheus metrics: the GPU through NVML when the service
runs on one, the process's CPU use otherwise.

On a CUDA device (``cuda``, ``cuda:N``) ``DeviceCollector`` loads ``pynvml``
(the ``nvidia-ml-py`` package) and reports, at each scrape::

    meshserve_gpu_utilization_ratio{gpu="N"}     NVML's "percent of time a kernel ran", / 100
    meshserve_gpu_memory_used_bytes{gpu="N"}     device memory in use (all processes)
    meshserve_gpu_memory_total_bytes{gpu="N"}

``N`` is the NVML index of the device: the ``cuda:N`` ordinal, which matches it
when ``CUDA_VISIBLE_DEVICES`` is unset. Without CUDA, or when NVML cannot start
(no driver, no ``pynvml``), it reports::

    meshserve_process_cpu_utilization_ratio      CPU seconds of this process / wall seconds / cores,
                                                 over the interval since the previous scrape

Tests pass a fake ``nvml`` module with the same functions; the calls made are the
same as with the real one.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def cuda_index(device: str) -> int | None:
    """The device ordinal of a torch device string: ``cuda`` → 0, ``cuda:1`` → 1,
    anything else (``cpu``) → None."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    return int(index) if index else 0


class CpuUtilization:
    """Process CPU utilization over the interval between two ``sample`` calls.

    Args:
        clock: wall clock (seconds).
        cpu_clock: CPU seconds of this process, all threads (``time.process_time``).
        num_cpus: cores the process may use (default ``os.cpu_count()``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time, num_cpus: int | None = None):
        self._clock, self._cpu_clock = clock, cpu_clock
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self._wall, self._cpu = clock(), cpu_clock()
        self._last = 0.0

    def sample(self) -> float:
        """CPU seconds / wall seconds / cores since the previous sample (or since
        construction), in [0, 1]; the previous value when no time has passed."""
        wall, cpu = self._clock(), self._cpu_clock()
        if wall > self._wall:
            self._last = min(1.0, max(0.0, (cpu - self._cpu) / (wall - self._wall) / self.num_cpus))
            self._wall, self._cpu = wall, cpu
        return self._last


class DeviceCollector(Collector):
    """Collects the device's utilization (see the module docstring).

    Args:
        device: the torch device the service computes on (``cpu``, ``cuda``, ``cuda:N``).
        nvml: an NVML module (default: ``import pynvml``, only on a CUDA device).
        cpu: the CPU sampler used without a GPU.
    """

    def __init__(self, device: str = "cpu", nvml=None, cpu: CpuUtilization | None = None):
        self.device = device
        self.gpu_index = cuda_index(device)
        self._nvml = None
        self._handle = None
        self._cpu = cpu or CpuUtilization()
        if self.gpu_index is not None:
            self._start_nvml(nvml)

    def _start_nvml(self, nvml) -> None:
        try:
            nvml = nvml if nvml is not None else importlib.import_module("pynvml")
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            self._nvml = nvml
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError (no driver, bad index): fall back
            log.warning("NVML unavailable on %s (%s: %s); reporting process CPU utilization instead",
                        self.device, type(exc).__name__, exc)

    @property
    def uses_nvml(self) -> bool:
        """True when the GPU metrics come from NVML."""
        return self._nvml is not None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._nvml is None:
            yield GaugeMetricFamily("meshserve_process_cpu_utilization_ratio",
                                    "CPU seconds of this process / wall seconds / cores, since the previous scrape.",
                                    value=self._cpu.sample())
            return
        gpu = str(self.gpu_index)
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        for name, doc, value in (
            ("meshserve_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (NVML).",
             util.gpu / 100.0),
            ("meshserve_gpu_memory_used_bytes", "Device memory in use, all processes (NVML).", mem.used),
            ("meshserve_gpu_memory_total_bytes", "Device memory (NVML).", mem.total),
        ):
            family = GaugeMetricFamily(name, doc, labels=["gpu"])
            family.add_metric([gpu], value)
            yield family

    def close(self) -> None:
        """Shuts NVML down (no-op without it)."""
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
