"""One benchmark run, start to finish: workload → target → warm-up → measured loop → report."""

from __future__ import annotations

import logging
import sys

from meshserve.bench.config import BenchConfig
from meshserve.bench.engine_stats import StatsSampler
from meshserve.bench.report import build_report, format_table, write_report
from meshserve.bench.targets import make_target
from meshserve.bench.workload import load_workloads

log = logging.getLogger(__name__)


async def run_bench(config: BenchConfig) -> dict:
    """Runs ``config`` and returns its report (see ``meshserve.bench.report``).

    The engine counters are read before and after the measured requests and
    sampled every ``config.stats_interval_s`` while they run. The target is always
    stopped, also when a request fails.

    Raises:
        BenchError: a request produced a different number of tokens than asked.
        FileNotFoundError: unknown model.
    """
    from meshserve.model_files import resolve_model

    files = resolve_model(config.model)
    workload, warmup = load_workloads(config.workload, config.warmup, files.path)
    target = make_target(config, files.path)
    concurrency = config.effective_concurrency
    try:
        log.info("starting target %s", config.target)
        await target.start()
        if warmup is not None:
            log.info("warm-up: %d request(s)", len(warmup.requests))
            await target.run(warmup.requests, concurrency)
        log.info("measuring %d requests at concurrency %d", len(workload.requests), concurrency)
        async with StatsSampler(target.read_stats, config.stats_interval_s) as sampler:
            results, wall_s = await target.run(workload.requests, concurrency)
    finally:
        await target.stop()
    return build_report(config, workload, results, wall_s, target.describe(), sampler.metrics())


def main(config: BenchConfig, report_json: str | None) -> int:
    """``meshserve bench``: runs, prints the table, writes the JSON; returns the exit code."""
    import asyncio

    report = asyncio.run(run_bench(config))
    print(format_table(report))
    if report_json:
        write_report(report, report_json)
        print(f"report written to {report_json}")
    sys.stdout.flush()
    return 0
