"""A sweep's report folder (``--report-dir``) and its terminal lines.

The folder holds:

* ``report.json``: the whole sweep (``meshserve.bench.sweep.run_sweep``), every
  point's full report of the target and of each baseline;
* ``summary.md``: the command, then one table row per point and system (output
  tokens/s, requests/s, TTFT, TPOT and e2e percentiles), one ratio table per
  baseline, and the plots;
* ``plots/*.png`` (``meshserve.bench.plots``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshserve.bench.plots import systems, write_plots


def _load(point: dict) -> str:
    if point["request_rate"] is None:
        return f"concurrency {point['concurrency']}"
    return "all at once" if point["request_rate"] == "inf" else f"{point['request_rate']:g} req/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000.0:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def points_table(doc: dict) -> list[str]:
    """Markdown rows: one per point and system (the target, then each baseline)."""
    lines = ["| load | system | requests | output tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms | e2e p50 s | e2e p99 s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in doc["points"]:
        for name, r in systems(doc, p):  # a baseline by its name: engine@float32 beside the target engine
            lines.append(f"| {_load(p)} | {name} | {r['num_requests']} | {r['output_tokens_per_s']:.1f} | "
                         f"{r['requests_per_s']:.2f} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                         f"{_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p99_s'])} | {r['e2e_p50_s']:.2f} | "
                         f"{r['e2e_p99_s']:.2f} |")
    return lines


def ratio_table(doc: dict, baseline: str) -> list[str]:
    """Markdown rows of target ÷ ``baseline`` (one of ``doc["baselines"]``), one row per point."""
    t, b = doc["target"], baseline
    lines = [f"| load | tokens/s {t} ÷ {b} | TTFT p50 {t} ÷ {b} | TPOT p50 {t} ÷ {b} |", "|---|---|---|---|"]
    for p in doc["points"]:
        q = p["ratios"][b]
        lines.append(f"| {_load(p)} | {_ratio(q['output_tokens_per_s'])} | {_ratio(q['ttft_p50_s'])} | "
                     f"{_ratio(q['tpot_p50_s'])} |")
    return lines


def ratio_lines(doc: dict) -> list[str]:
    """One ``ratio_table`` per baseline in run order, a blank line between two (empty without one)."""
    lines: list[str] = []
    for name in doc["baselines"]:
        lines += ([""] if lines else []) + ratio_table(doc, name)
    return lines


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _threads(report: dict) -> str:
    settings = report.get("engine") or report.get("hf_continuous") or {}
    return str(settings.get("num_threads", "?"))


def summary_markdown(doc: dict, command: str | None, plots: list[str]) -> str:
    """``summary.md`` of the sweep ``doc``; ``plots`` are paths relative to the folder."""
    first = doc["points"][0]["target"]
    versus = f" vs {', '.join(doc['baselines'])}" if doc["baselines"] else ""
    lines = [f"# meshserve bench: {doc['target']}{versus}", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    medians = ", ".join(f"{p['target']['prompt_len_median']:g} / {p['target']['output_len_median']:g}"
                        for p in doc["points"])
    lines += [f"Model `{doc['model']}` ({first['dtype']}), `{doc['workload']}` workload, "
              f"{first['num_requests']} requests per point (prompt / output median tokens per point: {medians}), "
              f"warm-up {first['warmup']}, sweep over {doc['sweep']['over']}: "
              f"{', '.join(str(v) for v in doc['sweep']['values'])}; {os.cpu_count()} CPU cores, "
              f"{_threads(first)} torch threads per target; the machine's 1-minute load average after "
              f"each point: {', '.join(_fmt(p.get('load_average_1m')) for p in doc['points'])}.", "",
              *points_table(doc), ""]
    if doc["baselines"]:
        lines += ["### Ratios to the baseline" + ("s" if len(doc["baselines"]) > 1 else ""), "",
                  "Target ÷ baseline at the same load, on the same requests: tokens/s above 1 and "
                  "TTFT / TPOT below 1 mean the target is faster"
                  + (", one table per baseline." if len(doc["baselines"]) > 1 else "."), "", *ratio_lines(doc), ""]
    lines += ["### Plots", "", *(f"![{Path(p).stem}]({p})" for p in plots), ""]
    return "\n".join(lines)


def write_report_dir(doc: dict, folder: str | Path, command: str | None = None) -> list[Path]:
    """Writes ``report.json``, ``summary.md`` and ``plots/*.png`` into ``folder`` (created).

    Returns:
        The files written: report.json, summary.md, then the plots.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    report.write_text(json.dumps(doc, indent=2) + "\n")
    plots = write_plots(doc, folder / "plots")
    summary = folder / "summary.md"
    summary.write_text(summary_markdown(doc, command, [p.relative_to(folder).as_posix() for p in plots]))
    return [report, summary, *plots]
