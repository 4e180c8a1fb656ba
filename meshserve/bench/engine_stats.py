"""Engine counters during a measured run: KV cache use, prefix-cache hits, preemptions.

The engine (``EngineStats``) and each executor (``Stats`` RPC) expose cumulative
counters and instantaneous gauges. ``StatsSampler`` reads them once before the
measured requests, every ``interval_s`` while they run, and once after; the
report then holds:

* ``kv_cache_utilization``: mean and max of the sampled ``kv_cache_utilization``
  (tokens stored / slots of the blocks requests hold), one value per engine per
  sample, counting only engines with a running request (an idle engine reports
  1.0, which says nothing);
* ``prefix_cache_hit_rate``: Δ``prefix_cache_hit_tokens`` / Δ``prefix_cache_queried_tokens``
  over the run (None when nothing was queried, e.g. prefix caching off);
* ``num_preemptions``: Δ``num_preemptions``;
* ``num_steps``: Δ``num_steps``, the engine steps the run took (summed over engines),
  and ``mean_num_running``: the mean of the sampled running requests (summed over
  engines): two systems at the same concurrency that differ here batch differently;
* ``max_num_running``: the most requests running at once in any sample (summed
  over engines);
* ``kv_capacity``: the cache size and what it allowed: ``requests_fit_paged`` is
  ``max_num_running`` (observed, so at most the concurrency), and
  ``requests_fit_reserved`` = ``num_blocks * block_size // max_model_len``, the
  requests a server that reserves ``max_model_len`` per request could hold.

Counters are deltas, so the warm-up requests never count.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from typing import Awaitable, Callable

# The report's engine fields, all None for targets without engine counters.
NULL_METRICS = {"kv_cache_utilization": None, "prefix_cache_hit_rate": None, "prefix_cache_queried_tokens": None,
                "prefix_cache_hit_tokens": None, "num_preemptions": None, "num_steps": None,
                "max_num_running": None, "mean_num_running": None, "kv_capacity": None}


@dataclass(frozen=True)
class CounterSnapshot:
    """The counters of one engine that the benchmark reads (from ``EngineStats`` or a
    ``StatsResponse``; both name them alike).

    Attributes:
        num_blocks / block_size / max_model_len: the cache's shape (blocks, tokens, tokens).
        num_running: requests in the running batch.
        kv_cache_utilization: tokens stored / slots of the blocks held, in [0, 1].
        num_preemptions / prefix_cache_queried_tokens / prefix_cache_hit_tokens / num_steps:
            cumulative counters.
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    num_running: int
    kv_cache_utilization: float
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int = 0

    @classmethod
    def of(cls, stats) -> "CounterSnapshot":
        """Copies the fields of an ``EngineStats`` or an ``executor_pb2.StatsResponse``."""
        return cls(int(stats.num_blocks), int(stats.block_size), int(stats.max_model_len), int(stats.num_running),
                   float(stats.kv_cache_utilization), int(stats.num_preemptions),
                   int(stats.prefix_cache_queried_tokens), int(stats.prefix_cache_hit_tokens), int(stats.num_steps))


@dataclass(frozen=True)
class Sample:
    """One reading of every engine.

    Attributes:
        utilizations: ``kv_cache_utilization`` of each engine that had a running request.
        num_running: running requests, summed over engines.
    """

    utilizations: tuple[float, ...]
    num_running: int

    @classmethod
    def of(cls, snapshots: list[CounterSnapshot]) -> "Sample":
        return cls(tuple(s.kv_cache_utilization for s in snapshots if s.num_running > 0),
                   sum(s.num_running for s in snapshots))


ReadFn = Callable[[], Awaitable["list[CounterSnapshot] | None"]]


class StatsSampler:
    """Reads the counters before, during (every ``interval_s``) and after a run.

    Use as ``async with StatsSampler(target.read_stats, 0.5) as sampler: ...``,
    then ``sampler.metrics()``. When ``read`` returns None the sampler stays idle
    and ``metrics()`` gives ``NULL_METRICS``.
    """

    def __init__(self, read: ReadFn, interval_s: float):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._read = read
        self.interval_s = interval_s
        self.before: list[CounterSnapshot] | None = None
        self.after: list[CounterSnapshot] | None = None
        self.samples: list[Sample] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "StatsSampler":
        self.before = await self._read()
        if self.before is not None:
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        if exc[0] is None:
            self.after = await self._read()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            snapshots = await self._read()
            if snapshots is not None:
                self.samples.append(Sample.of(snapshots))

    def metrics(self) -> dict:
        """The report's engine fields (see the module doc); ``NULL_METRICS`` without counters."""
        if self.before is None or self.after is None:
            return dict(NULL_METRICS)
        return run_metrics(self.before, self.after, self.samples)


def run_metrics(before: list[CounterSnapshot], after: list[CounterSnapshot], samples: list[Sample]) -> dict:
    """The report's engine fields from the counters before and after a run and the samples between.

    Raises:
        ValueError: ``before`` and ``after`` read a different number of engines.
    """
    if len(before) != len(after):
        raise ValueError(f"{len(before)} engines before the run, {len(after)} after")

    def delta(name: str) -> int:
        return sum(getattr(s, name) for s in after) - sum(getattr(s, name) for s in before)

    queried, hits = delta("prefix_cache_queried_tokens"), delta("prefix_cache_hit_tokens")
    utils = [u for s in samples for u in s.utilizations]
    max_running = max((s.num_running for s in samples), default=None)
    return {
        "kv_cache_utilization": {"mean": statistics.fmean(utils) if utils else None,
                                 "max": max(utils) if utils else None, "num_samples": len(utils)},
        "prefix_cache_hit_rate": hits / queried if queried else None,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_hit_tokens": hits,
        "num_preemptions": delta("num_preemptions"),
        "num_steps": delta("num_steps"),
        "max_num_running": max_running,
        "mean_num_running": statistics.fmean(s.num_running for s in samples) if samples else None,
        "kv_capacity": {
            "num_blocks": sum(s.num_blocks for s in after),
            "block_size": after[0].block_size,
            "max_model_len": after[0].max_model_len,
            "requests_fit_paged": max_running,
            "requests_fit_reserved": sum(s.num_blocks * s.block_size // s.max_model_len for s in after),
        },
    }
