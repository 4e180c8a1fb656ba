"""The executor's Prometheus metrics, read at scrape time from the engine's own
counters (``EngineStats``): nothing here re-derives what the engine counts.

================================================  =======  ==============================================
metric                                            type     source
================================================  =======  ==============================================
meshserve_engine_requests_running                 gauge    ``num_running``
meshserve_engine_requests_waiting                 gauge    ``num_waiting`` (new or preempted)
meshserve_engine_prompt_tokens_total              counter  ``num_prompt_tokens`` (computed, recomputes in)
meshserve_engine_generation_tokens_total          counter  ``num_generation_tokens``
meshserve_engine_preemptions_total                counter  ``num_preemptions``
meshserve_engine_steps_total                      counter  ``num_steps``
meshserve_engine_requests_finished_total          counter  ``num_finished`` (aborts included)
meshserve_engine_requests_aborted_total           counter  ``num_aborted``
meshserve_kv_cache_usage_ratio                    gauge    blocks held by requests / ``num_blocks``
meshserve_kv_cache_blocks{state}                  gauge    total, free, cached_free
meshserve_prefix_cache_queried_tokens_total       counter  ``prefix_cache_queried_tokens``
meshserve_prefix_cache_hit_tokens_total           counter  ``prefix_cache_hit_tokens``
meshserve_prefix_cache_hit_ratio                  gauge    hit / queried tokens since start
meshserve_executor_kvstore_queried_tokens_total   counter  ``kvstore_queried_tokens``
meshserve_executor_kvstore_hit_tokens_total       counter  ``kvstore_hit_tokens``
meshserve_executor_kvstore_hit_ratio              gauge    hit / queried tokens since start
meshserve_executor_kvstore_fetch_seconds          summary  connector ``fetches`` / ``fetch_seconds``
meshserve_executor_kvstore_{received,sent}_bytes_total     connector ``bytes_in`` / ``bytes_out``
meshserve_executor_kvstore_fetch_failures_total   counter  connector ``fetch_failures``
meshserve_engine_forward_seconds_total            counter  ``forward_seconds``
meshserve_engine_forward_tokens_total             counter  ``num_forward_tokens``
meshserve_engine_busy_ratio                       gauge    Δforward_seconds / Δwall, since the last scrape
meshserve_model_flops_utilization_ratio           gauge    2·params·Δtokens / Δforward_seconds / peak
meshserve_model_parameters                        gauge    parameters of the model
meshserve_device_peak_flops                       gauge    the peak used for the MFU (FLOP/s)
meshserve_executor_slow_reader_aborts_total       counter  requests ended because their reader fell
                                                           ``max_buffered_outputs`` behind
================================================  =======  ==============================================

The kvstore connector's metrics are 0 without a connector. Busy fraction and
MFU cover the interval since the previous scrape (since start at the first);
``rate()`` over the two ``forward`` counters gives the same over any window.
MFU follows the usual estimate of a decoder's forward cost, 2 FLOPs per
parameter per token (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models"; PaLM's MFU, Chowdhery et al. 2022), ignoring attention's own FLOPs.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from executor.engine.outputs import EngineStats
from meshserve.device_metrics import DeviceCollector
from meshserve.metrics import new_registry

# Peak dense bf16/fp16 tensor FLOP/s by device name (vendor data sheets), for the
# MFU estimate when --peak-flops is not given. A CPU gets a nominal 1 TFLOP/s:
# set --peak-flops to your machine's figure for a meaningful CPU MFU.
PEAK_FLOPS_BY_NAME = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
                      ("A10", 125e12), ("V100", 125e12), ("T4", 65e12))
DEFAULT_GPU_PEAK_FLOPS = 100e12
DEFAULT_CPU_PEAK_FLOPS = 1e12


def default_peak_flops(device: str, device_name: str | None = None) -> float:
    """Peak FLOP/s assumed for ``device`` (see ``PEAK_FLOPS_BY_NAME``).

    Args:
        device: torch device string (``cpu``, ``cuda:0``…).
        device_name: the CUDA device's name (default: asked of torch).
    """
    if not device.startswith("cuda"):
        return DEFAULT_CPU_PEAK_FLOPS
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS_BY_NAME if key in device_name), DEFAULT_GPU_PEAK_FLOPS)


class UtilizationWindow:
    """Busy fraction and MFU over the interval between two ``update`` calls.

    Args:
        num_params: model parameters.
        peak_flops: the device's peak FLOP/s (> 0).
        now: the window's start (seconds, same clock as ``update``).
        forward_seconds, forward_tokens: the counters at ``now``.

    Raises:
        ValueError: ``peak_flops`` <= 0.
    """

    def __init__(self, num_params: int, peak_flops: float, now: float, forward_seconds: float = 0.0,
                 forward_tokens: int = 0):
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
        self.num_params, self.peak_flops = num_params, peak_flops
        self._at, self._seconds, self._tokens = now, forward_seconds, forward_tokens
        self.busy, self.mfu = 0.0, 0.0

    def update(self, now: float, forward_seconds: float, forward_tokens: int) -> tuple[float, float]:
        """Returns ``(busy fraction, MFU)`` since the previous call, both in [0, 1]
        (MFU 0 when no forward ran); the previous values when no time passed."""
        wall = now - self._at
        if wall <= 0:
            return self.busy, self.mfu
        busy_s, tokens = forward_seconds - self._seconds, forward_tokens - self._tokens
        self.busy = min(1.0, max(0.0, busy_s / wall))
        self.mfu = min(1.0, 2.0 * self.num_params * tokens / busy_s / self.peak_flops) if busy_s > 0 else 0.0
        self._at, self._seconds, self._tokens = now, forward_seconds, forward_tokens
        return self.busy, self.mfu


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class EngineCollector(Collector):
    """Collects the table of the module docstring from ``stats()`` at each scrape.

    Args:
        stats: the engine's latest counters (``AsyncEngine.stats``; thread-safe).
        num_params: model parameters (for the MFU).
        peak_flops: the device's peak FLOP/s.
        clock: wall clock (seconds).
    """

    def __init__(self, stats: Callable[[], EngineStats], num_params: int, peak_flops: float,
                 clock: Callable[[], float] = time.monotonic):
        self._stats, self._clock = stats, clock
        s = stats()
        self.window = UtilizationWindow(num_params, peak_flops, clock(), s.forward_seconds, s.num_forward_tokens)

    def collect(self) -> Iterator:
        s = self._stats()
        busy, mfu = self.window.update(self._clock(), s.forward_seconds, s.num_forward_tokens)
        yield from self._requests(s)
        yield from self._cache(s)
        yield from self._kvstore(s)
        yield _counter("meshserve_engine_forward_seconds", "Seconds spent in forward passes.", s.forward_seconds)
        yield _counter("meshserve_engine_forward_tokens", "Tokens run through forward passes.", s.num_forward_tokens)
        yield _gauge("meshserve_engine_busy_ratio", "Time in forward / wall time since the previous scrape.", busy)
        yield _gauge("meshserve_model_flops_utilization_ratio", "2 * params * tokens / forward seconds / peak "
                     "FLOP/s since the previous scrape.", mfu)
        yield _gauge("meshserve_model_parameters", "Parameters of the served model.", self.window.num_params)
        yield _gauge("meshserve_device_peak_flops", "Peak FLOP/s assumed for the MFU.", self.window.peak_flops)

    @staticmethod
    def _requests(s: EngineStats) -> Iterator:
        yield _gauge("meshserve_engine_requests_running", "Requests in the running batch.", s.num_running)
        yield _gauge("meshserve_engine_requests_waiting", "Requests waiting (new or preempted).", s.num_waiting)
        yield _counter("meshserve_engine_prompt_tokens", "Prompt tokens computed (cache hits excluded, "
                       "recomputes included).", s.num_prompt_tokens)
        yield _counter("meshserve_engine_generation_tokens", "Tokens sampled.", s.num_generation_tokens)
        yield _counter("meshserve_engine_preemptions", "Requests preempted (recompute).", s.num_preemptions)
        yield _counter("meshserve_engine_steps", "Engine steps that ran a batch.", s.num_steps)
        yield _counter("meshserve_engine_requests_finished", "Requests finished, aborts included.", s.num_finished)
        yield _counter("meshserve_engine_requests_aborted", "Requests aborted.", s.num_aborted)

    @staticmethod
    def _cache(s: EngineStats) -> Iterator:
        yield _gauge("meshserve_kv_cache_usage_ratio", "KV blocks held by requests / all KV blocks.",
                     (s.num_blocks - s.num_free_blocks) / s.num_blocks if s.num_blocks else 0.0)
        blocks = GaugeMetricFamily("meshserve_kv_cache_blocks", "KV blocks: total, free (incl. cached_free), "
                                   "cached_free (free but holding reusable prefix KV).", labels=["state"])
        for state, value in (("total", s.num_blocks), ("free", s.num_free_blocks),
                             ("cached_free", s.num_cached_free_blocks)):
            blocks.add_metric([state], value)
        yield blocks
        yield _counter("meshserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                       s.prefix_cache_queried_tokens)
        yield _counter("meshserve_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache.",
                       s.prefix_cache_hit_tokens)
        yield _gauge("meshserve_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens since start.",
                     s.prefix_cache_hit_rate)

    @staticmethod
    def _kvstore(s: EngineStats) -> Iterator:
        yield _counter("meshserve_executor_kvstore_queried_tokens", "Prompt tokens asked of the kvstore.",
                       s.kvstore_queried_tokens)
        yield _counter("meshserve_executor_kvstore_hit_tokens", "Prompt tokens loaded from the kvstore.",
                       s.kvstore_hit_tokens)
        yield _gauge("meshserve_executor_kvstore_hit_ratio", "kvstore hit tokens / queried tokens since start.",
                     s.kvstore_hit_tokens / s.kvstore_queried_tokens if s.kvstore_queried_tokens else 0.0)
        c = s.kvstore
        yield SummaryMetricFamily("meshserve_executor_kvstore_fetch_seconds", "kvstore fetches: start to finish.",
                                  count_value=c.fetches if c else 0, sum_value=c.fetch_seconds if c else 0.0)
        yield _counter("meshserve_executor_kvstore_received_bytes", "KV payload bytes fetched from the kvstore.",
                       c.bytes_in if c else 0)
        yield _counter("meshserve_executor_kvstore_sent_bytes", "KV payload bytes published to the kvstore.",
                       c.bytes_out if c else 0)
        yield _counter("meshserve_executor_kvstore_fetch_failures", "kvstore fetches that failed or timed out.",
                       c.fetch_failures if c else 0)


class SlowReaderCollector(Collector):
    """``meshserve_executor_slow_reader_aborts_total`` from a callable (the
    ``AsyncEngine``'s ``num_overflowed``)."""

    def __init__(self, num_aborts: Callable[[], int]):
        self._num_aborts = num_aborts

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield _counter("meshserve_executor_slow_reader_aborts", "Requests ended with RESOURCE_EXHAUSTED because "
                       "their reader left max_buffered_outputs messages untaken.", self._num_aborts())


def executor_registry(stats: Callable[[], EngineStats], num_params: int, device: str = "cpu",
                      peak_flops: float | None = None, nvml=None,
                      slow_reader_aborts: Callable[[], int] | None = None,
                      registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The executor's registry: engine counters (``EngineCollector``) and device
    utilization (``DeviceCollector``: NVML on CUDA, process CPU otherwise).

    Args:
        stats: the engine's latest counters.
        num_params: model parameters.
        device: the engine's torch device.
        peak_flops: peak FLOP/s for the MFU (default ``default_peak_flops(device)``).
        nvml: an NVML module for tests (default ``pynvml`` on CUDA).
        slow_reader_aborts: the count of slow-reader aborts (None: not exported).
        registry: a ``new_registry("executor")`` to fill, one already served while the
            model loaded (None: a new one).
    """
    registry = registry or new_registry("executor")
    registry.register(EngineCollector(stats, num_params, peak_flops or default_peak_flops(device)))
    registry.register(DeviceCollector(device, nvml))
    if slow_reader_aborts is not None:
        registry.register(SlowReaderCollector(slow_reader_aborts))
    return registry
