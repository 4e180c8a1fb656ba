"""One benchmark run, start to finish: workload → target → warm-up → measured loop → report."""

from __future__ import annotations

import logging
import sys

from meshserve.bench.config import BenchConfig
from meshserve.bench.loop import run_closed_loop
from meshserve.bench.report import build_report, format_table, write_report
from meshserve.bench.targets import make_target
from meshserve.bench.workload import make_warmup, make_workload, model_vocabulary

log = logging.getLogger(__name__)


async def run_bench(config: BenchConfig) -> dict:
    """Runs ``config`` and returns its report (see ``meshserve.bench.report``).

    The target is always stopped, also when a request fails.

    Raises:
        BenchError: a request produced a different number of tokens than asked.
        FileNotFoundError: unknown model.
    """
    from meshserve.model_files import resolve_model

    files = resolve_model(config.model)
    vocab_size, specials = model_vocabulary(files.path)
    workload = make_workload(config.workload, vocab_size, specials)
    warmup = make_warmup(config.workload, config.warmup, vocab_size, specials)
    target = make_target(config, files.path)
    concurrency = config.effective_concurrency
    try:
        log.info("starting target %s", config.target)
        await target.start()
        if warmup is not None:
            log.info("warm-up: %d request(s)", len(warmup.requests))
            await run_closed_loop(warmup.requests, concurrency, target.send)
        log.info("measuring %d requests at concurrency %d", len(workload.requests), concurrency)
        results, wall_s = await run_closed_loop(workload.requests, concurrency, target.send)
    finally:
        await target.stop()
    return build_report(config, workload, results, wall_s, target.describe())


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
