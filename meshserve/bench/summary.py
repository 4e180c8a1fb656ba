"""Summarises a folder of bench reports (``make bench-compare``): per target and
concurrency the median over rounds of output tokens/s and TTFT p50, and the mesh
/ engine and engine / hf-generate throughput ratios. Writes ``summary.md`` there.

Usage: ``python -m meshserve.bench.summary REPORT_DIR``
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def summarise(folder: Path) -> str:
    """The Markdown summary of every ``*.json`` report in ``folder``."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        if "output_tokens_per_s" in report:
            runs[(report["target"], int(report["concurrency"]))].append(report)
    med = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    lines = ["| target | concurrency | rounds | output tokens/s (median) | TTFT p50 s | TPOT p50 s |",
             "|---|---|---|---|---|---|"]
    for (target, conc), reports in sorted(runs.items()):
        ttft = statistics.median(r["ttft_p50_s"] for r in reports)
        tpot = statistics.median(r["tpot_p50_s"] for r in reports)
        lines.append(f"| {target} | {conc} | {len(reports)} | {med[(target, conc)]:.1f} | {ttft:.3f} | {tpot:.3f} |")
    hf = [v for (t, _), v in med.items() if t == "hf-generate"]
    lines += ["", "| concurrency | mesh / engine | engine / hf-generate |", "|---|---|---|"]
    for conc in sorted({c for t, c in med if t == "engine"}):
        engine = med[("engine", conc)]
        mesh = med.get(("mesh", conc))
        ratio = f"{mesh / engine:.2f}" if mesh else "-"
        vs_hf = f"{engine / hf[0]:.2f}" if hf else "-"
        lines.append(f"| {conc} | {ratio} | {vs_hf} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "reports")
    text = summarise(folder)
    (folder / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
