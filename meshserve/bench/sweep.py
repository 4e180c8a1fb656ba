"""A sweep: one target (and optionally transformers baselines) over several loads.

A sweep point is a load: a concurrency (closed loop) or a request rate (open
loop, Poisson arrivals). The target and every baseline are started and warmed up
once, then measured point after point, the baselines one after the other right
after the target, on the same requests (interleaved, so all see the same machine
state over time). Each baseline is its own transformers model copy.

Each point draws its own requests (same spec, its own seed: point 0 keeps
``--seed``, point ``i`` takes ``point_seed(seed, i)``), so a prefix cache never
serves a point with blocks of an earlier one; the report names every point's
seed, and ``--seed`` with it replays the point. A jsonl workload is the same file
at every point.

Ratios are target ÷ baseline at the same point, one set per baseline: output
tokens/s (above 1: the target is faster), TTFT p50 and TPOT p50 (below 1: the
target is faster).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from meshserve.bench.arrivals import poisson_arrivals
from meshserve.bench.config import DTYPES, BenchConfig
from meshserve.bench.cpu_wait import CpuWaitProbe
from meshserve.bench.engine_stats import StatsSampler
from meshserve.bench.hf_targets import check_hf_workload
from meshserve.bench.progress import ProgressBars
from meshserve.bench.report import build_report, json_rate
from meshserve.bench.target import Target
from meshserve.bench.targets import make_target
from meshserve.bench.workload import Workload, make_warmup, model_vocabulary
from meshserve.bench.workload_kinds import load_workloads
from meshserve.model_files import resolve_model

log = logging.getLogger(__name__)

BASELINES = ("hf-generate", "hf-static", "hf-continuous", "vllm")
POINT_STREAM = 3  # arrivals.ARRIVAL_STREAM is 2, workload.WARMUP_STREAM 1
RATIO_KEYS = ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s")


@dataclass(frozen=True)
class SweepPoint:
    """One load: ``concurrency`` requests in flight, or Poisson arrivals at
    ``request_rate`` requests/s (``math.inf``: all at once) when it is set."""

    concurrency: int
    request_rate: float | None = None

    @property
    def label(self) -> str:
        """"c4" or "r0.5" (bars, file names)."""
        return f"c{self.concurrency}" if self.request_rate is None else f"r{self.request_rate:g}"


def parse_values(text: str | None, kind: type) -> list:
    """``"1,4,16"`` → ``[1, 4, 16]`` (``kind`` int or float; float takes "inf"); [] for None or "".

    Raises:
        ValueError: an item is not a ``kind``.
    """
    try:
        return [kind(item) for item in (text or "").split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None


def sweep_points(concurrency: int, request_rate: float | None, sweep_concurrency: Sequence[int] = (),
                 sweep_rate: Sequence[float] = ()) -> list[SweepPoint]:
    """The points of a run: each of ``sweep_concurrency``, each of ``sweep_rate``, or the one
    load ``(concurrency, request_rate)`` when neither is given.

    Raises:
        ValueError: both sweeps given, a sweep given with ``request_rate``, a concurrency
            < 1, a rate <= 0, or a value repeated.
    """
    if sweep_concurrency and sweep_rate:
        raise ValueError("sweep either concurrencies or request rates, not both")
    if sweep_concurrency and request_rate is not None:
        raise ValueError("--sweep-concurrency runs the closed loop; drop --request-rate")
    values = list(sweep_concurrency or sweep_rate)
    if len(set(values)) != len(values):
        raise ValueError(f"a sweep value is repeated: {values}")
    if sweep_concurrency:
        if min(values) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {values}")
        return [SweepPoint(c) for c in values]
    if sweep_rate:
        if not min(values) > 0:
            raise ValueError(f"request rates must be > 0, got {values}")
        return [SweepPoint(concurrency, r) for r in values]
    return [SweepPoint(concurrency, request_rate)]


def parse_baselines(text: str | None) -> list[str]:
    """``"hf-generate,hf-continuous"`` → ``["hf-generate", "hf-continuous"]`` (the order they run
    in at every point); [] for None or "". A name may carry its own dtype, ``NAME@DTYPE``
    (``vllm@bfloat16``, ``engine@bfloat16``: the engine itself in another dtype); without
    one a baseline runs in the run's ``--dtype``.

    Raises:
        ValueError: a name is not one of ``BASELINES`` (or ``engine`` with a dtype), a dtype
            is not one of ``DTYPES``, or a name is repeated.
    """
    names = [item.strip() for item in (text or "").split(",") if item.strip()]
    check_baselines(names)
    return names


def check_baselines(names: Sequence[str], open_loop: bool = False) -> None:
    """Refuses what a sweep cannot run as baselines.

    Args:
        names: the baselines, in their order.
        open_loop: whether a point of the sweep has a request rate.

    Raises:
        ValueError: a name is not one of ``BASELINES``, a name is repeated, or hf-static
            is asked for in the open loop (it runs static batches only).
    """
    for name in names:
        base, _, dtype = name.partition("@")
        if not (base in BASELINES or (base == "engine" and dtype)):
            raise ValueError(f"--baseline must be one of {', '.join(BASELINES)} (each may add @DTYPE; "
                             f"engine@DTYPE: the engine in another dtype), got {name!r}")
        if dtype and dtype not in DTYPES:
            raise ValueError(f"--baseline {name!r}: the dtype must be one of {', '.join(DTYPES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--baseline names {', '.join(repeated)} more than once")
    bases = [n.partition("@")[0] for n in names]
    if open_loop and "hf-static" in bases:
        raise ValueError("hf-static runs static batches and has no open loop; use another baseline")
    if open_loop and "vllm" in bases:
        raise ValueError("the vllm baseline runs the closed loop only; drop --request-rate")


def _baseline_config(config: BenchConfig, name: str) -> BenchConfig:
    """The run's config for baseline ``name`` (``NAME`` or ``NAME@DTYPE``)."""
    base, _, dtype = name.partition("@")
    return replace(config, target=base, addr=None, executor_addrs=(), dtype=dtype or config.dtype)


def point_seed(seed: int, index: int) -> int:
    """The workload seed of sweep point ``index``: ``seed`` for the first, then an
    independent draw of ``SeedSequence([seed, POINT_STREAM, index])``."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, POINT_STREAM, index]).generate_state(1)[0])


def ratios(target: dict, baseline: dict) -> dict[str, float | None]:
    """Target ÷ baseline of ``RATIO_KEYS`` (None where the baseline's value is 0)."""
    return {k: target[k] / baseline[k] if baseline[k] else None for k in RATIO_KEYS}


async def _measure(target: Target, cfg: BenchConfig, workload: Workload, bars: ProgressBars, label: str) -> dict:
    """One measured run of ``workload`` on a started ``target`` at ``cfg``'s load; its report."""
    requests = workload.requests
    arrivals = (poisson_arrivals(len(requests), cfg.request_rate, cfg.workload.seed)
                if cfg.request_rate is not None else None)
    on_result = bars.bar(label, len(requests))
    probe = CpuWaitProbe(target.processes())
    probe.start()
    async with StatsSampler(target.read_stats, cfg.stats_interval_s) as sampler:
        results, wall_s = await target.run(requests, cfg.effective_concurrency or 1, arrivals, on_result)
    report = build_report(cfg, workload, results, wall_s, target.describe(), sampler.metrics())
    report["cpu_wait"] = {name: wait.to_json() for name, wait in probe.finish().items()}
    return report


async def run_sweep(config: BenchConfig, points: Sequence[SweepPoint], baselines: Sequence[str] = (),
                    bars: ProgressBars | None = None) -> dict:
    """Measures ``config.target`` and each of ``baselines`` at every point; the sweep's report.

    Args:
        config: the run (its ``concurrency`` / ``request_rate`` are replaced by each point's).
        points: the loads (``sweep_points``).
        baselines: names out of ``BASELINES`` (none, one or several, each once), run in
            this order on the same requests right after the target at every point.
        bars: the progress bars (None: none).

    Returns:
        ``{"target", "baselines": [name, ...], "model", "workload", "sweep": {"over", "values"},
        "points": [{"point", "concurrency", "request_rate", "seed", "target": report,
        "baselines": {name: report}, "ratios": {name: {...}}, "load_average_1m"}]}``: the
        point's ``baselines`` and ``ratios`` hold one entry per baseline, in the order of
        ``baselines`` (empty without one); reports as ``meshserve.bench.report.build_report``;
        ratios as ``ratios``; ``load_average_1m``: the machine's 1-minute load average,
        ``os.getloadavg``, when the point ended.

    Raises:
        ValueError: an unknown or repeated baseline, hf-static in the open loop, or a workload
            a transformers target cannot run (all before any target starts).
        BenchError: a request produced another number of tokens than asked.
    """
    baselines = list(baselines)
    open_loop = any(p.request_rate is not None for p in points)
    check_baselines(baselines, open_loop)
    bars = bars or ProgressBars(enabled=False)
    path = resolve_model(config.model).path
    # (None: the target, else the baseline's name, its config); the target runs first at every point
    systems = [(None, config)] + [(name, _baseline_config(config, name)) for name in baselines]
    workloads = [load_workloads(replace(config.workload, seed=point_seed(config.workload.seed, i)), 0, path)[0]
                 for i in range(len(points))]
    for _, cfg in systems:
        if cfg.target in BASELINES:
            for wl in workloads:
                check_hf_workload(cfg.target, wl.requests, open_loop)
    targets = [make_target(cfg, path) for _, cfg in systems]
    warmup = make_warmup(config.workload, config.warmup, *model_vocabulary(path))
    doc_points = []
    try:
        for (name, cfg), target in zip(systems, targets):
            log.info("starting %s %s", "target" if name is None else "baseline", cfg.target)
            await target.start()
            if warmup is not None:
                await target.run(warmup.requests, replace(cfg, request_rate=None).effective_concurrency)
        for i, (point, workload) in enumerate(zip(points, workloads)):
            entry = {"point": i, "concurrency": point.concurrency if point.request_rate is None else None,
                     "request_rate": json_rate(point.request_rate), "seed": workload.spec.seed,
                     "target": None, "baselines": {}}
            for (name, cfg), target in zip(systems, targets):
                cfg = replace(cfg, concurrency=point.concurrency, request_rate=point.request_rate,
                              workload=workload.spec)
                log.info("point %s: %s, %d requests", point.label, cfg.target, len(workload.requests))
                report = await _measure(target, cfg, workload, bars, f"{cfg.target} {point.label}")
                if name is None:
                    entry["target"] = report
                else:
                    entry["baselines"][name] = report
            entry["load_average_1m"] = os.getloadavg()[0]  # other work on the machine skews every figure
            entry["ratios"] = {name: ratios(entry["target"], b) for name, b in entry["baselines"].items()}
            doc_points.append(entry)
    finally:
        for target in targets:
            await target.stop()
    over = "request_rate" if open_loop else "concurrency"
    return {"target": config.target, "baselines": baselines, "model": config.model,
            "workload": config.workload.kind, "sweep": {"over": over, "values": [p[over] for p in doc_points]},
            "points": doc_points}
