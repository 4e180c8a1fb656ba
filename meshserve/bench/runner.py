"""One ``meshserve bench`` invocation, start to finish: the sweep (one point or many, with no,
one or several baselines) → the terminal tables → the JSON report / the report folder."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Sequence

from meshserve.bench.config import BenchConfig
from meshserve.bench.progress import ProgressBars, live_progress_enabled
from meshserve.bench.report import format_table, write_report
from meshserve.bench.sweep import SweepPoint, run_sweep
from meshserve.bench.sweep_report import ratio_lines, systems, write_report_dir

log = logging.getLogger(__name__)


async def run_bench(config: BenchConfig) -> dict:
    """Runs ``config`` at its one load and returns its report (see ``meshserve.bench.report``).

    The engine counters are read before and after the measured requests and
    sampled every ``config.stats_interval_s`` while they run. The target is always
    stopped, also when a request fails.

    Raises:
        BenchError: a request produced a different number of tokens than asked.
        FileNotFoundError: unknown model.
    """
    doc = await run_sweep(config, [SweepPoint(config.concurrency, config.request_rate)])
    return doc["points"][0]["target"]


def main(config: BenchConfig, report_json: str | None, points: Sequence[SweepPoint] | None = None,
         baselines: Sequence[str] = (), report_dir: str | None = None, quiet: bool = False,
         command: str | None = None) -> int:
    """``meshserve bench``: runs every point, prints each run's table and one ratio table per
    baseline, writes the JSON and the report folder; returns the exit code.

    ``baselines``: names out of ``meshserve.bench.sweep.BASELINES``, run in this order
    after the target at every point. ``--report-json`` holds the one run's report when
    there is one point and no baseline (what ``meshserve.bench.summary`` reads), the
    whole sweep otherwise.
    """
    points = list(points or [SweepPoint(config.concurrency, config.request_rate)])
    with ProgressBars(live_progress_enabled(quiet)) as bars:
        doc = asyncio.run(run_sweep(config, points, baselines, bars))
    for p in doc["points"]:
        for _, report in systems(doc, p):
            print(format_table(report) + "\n")
    if baselines:
        print("\n".join(["target ÷ baseline (tokens/s above 1, TTFT/TPOT below 1: the target is faster)",
                         *ratio_lines(doc)]))
    if report_json:
        single = len(points) == 1 and not baselines
        write_report(doc["points"][0]["target"] if single else doc, report_json)
        print(f"report written to {report_json}")
    if report_dir:
        files = write_report_dir(doc, report_dir, command)
        print(f"report folder {report_dir}: " + ", ".join(str(Path(f).relative_to(report_dir)) for f in files))
    sys.stdout.flush()
    return 0
