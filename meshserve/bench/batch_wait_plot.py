"""``python -m meshserve.bench.batch_wait_plot FOLDER``: the ``--max-batch-wait-ms`` curve
of the engine from the flat ``--report-json`` files in ``FOLDER`` (one per wait; several
rounds of a wait are summarised by their medians).

Writes ``FOLDER/batch_wait.png`` (output tokens/s, and TTFT p50 and p99 in ms, each
against the wait in ms) and ``FOLDER/summary.md`` (the same figures as a table, with
the number of runs behind each row). Reports of other targets, open-loop runs and
other workloads are skipped; the folder must hold at least one engine report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshserve.bench.plots import _pyplot
from meshserve.bench.summary import load_runs, median

KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def curve(folder: Path) -> list[dict]:
    """One row per wait, ascending: ``wait_ms``, ``runs``, and the median of each of ``KEYS``.

    Raises:
        ValueError: no engine report in ``folder``.
    """
    rows = []
    for variant, reports in load_runs(folder).items():
        if variant.target != "engine":
            continue
        rows.append({"wait_ms": variant.wait_ms, "runs": len(reports),
                     "workload": variant.workload, "concurrency": variant.concurrency,
                     **{k: median(reports, k) for k in KEYS}})
    if not rows:
        raise ValueError(f"no closed-loop engine report (--report-json) in {folder}")
    return sorted(rows, key=lambda r: (r["workload"], r["concurrency"], r["wait_ms"]))


def write(folder: Path) -> list[Path]:
    """Writes the plot and the table; returns their paths."""
    rows = curve(folder)
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    waits = [r["wait_ms"] for r in rows]
    ax_tp.plot(waits, [r["output_tokens_per_s"] for r in rows], "o-")
    ax_tp.set(xlabel="--max-batch-wait-ms", ylabel="output tokens/s", title="throughput")
    for key, style in (("ttft_p50_s", "o-"), ("ttft_p99_s", "s--")):
        ax_ttft.plot(waits, [1e3 * r[key] if r[key] is not None else None for r in rows], style,
                     label=key.split("_")[1])
    ax_ttft.set(xlabel="--max-batch-wait-ms", ylabel="TTFT ms", title="time to first token")
    ax_ttft.legend()
    first = rows[0]
    fig.suptitle(f"engine, {first['workload']} workload, concurrency {first['concurrency']}")
    fig.tight_layout()
    png = folder / "batch_wait.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines = ["| wait ms | runs | output tokens/s | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['wait_ms']:g} | {r['runs']} | {r['output_tokens_per_s']:.1f} | "
                     f"{1e3 * r['ttft_p50_s']:.0f} | {1e3 * r['ttft_p99_s']:.0f} |")
    md = folder / "summary.md"
    md.write_text("\n".join(lines) + "\n\n![batch wait](batch_wait.png)\n")
    return [png, md]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.batch_wait_plot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of meshserve bench --report-json files")
    args = parser.parse_args(argv)
    try:
        for path in write(Path(args.folder)):
            print(path)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
