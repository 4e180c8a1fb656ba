"""Summarises folders of bench reports as Markdown tables of medians over rounds.

Each folder is one experiment: its ``*.json`` reports are grouped into variants
(workload, target, concurrency, dtype, prefix caching, batch wait) and every
figure is the median over the variant's rounds. Tables, each printed when its
reports are there:

* throughput by target (synthetic workload, default engine settings), with
  engine ÷ target at the same concurrency, and the mesh / engine and
  engine / hf-generate ratios (``make bench-compare``);
* prefix caching on vs off on the shared-prefix workload: TTFT p50 off ÷ on and
  throughput on ÷ off (``make bench-batching``);
* the engine's ``--max-batch-wait-ms`` sweep against wait 0 (``make bench-batching``);
* KV cache use of the engine targets (utilization, requests running, requests a
  max_model_len reservation would fit, preemptions).

Sub-folders holding reports are summarised after their parent, each in its own
section and its own ``summary.md``.

Usage: ``python -m meshserve.bench.summary REPORT_DIR``
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple


class Variant(NamedTuple):
    """What a group of rounds has in common."""

    workload: str
    target: str
    concurrency: int
    dtype: str
    prefix_caching: bool
    wait_ms: float


def variant_of(report: dict) -> Variant:
    """The variant of a report (reports older than these fields: synthetic, defaults)."""
    engine = report.get("engine") or {}
    sharing = (report.get("hf_continuous") or {}).get("allow_block_sharing", True)
    return Variant(report.get("workload", "synthetic"), report["target"], int(report["concurrency"]),
                   report.get("dtype", "?"), bool(engine.get("enable_prefix_caching", sharing)),
                   float(engine.get("max_batch_wait_ms", 0.0)))


def load_runs(folder: Path) -> dict[Variant, list[dict]]:
    """The reports of ``folder`` (not its sub-folders) grouped by variant."""
    runs: dict[Variant, list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        if "output_tokens_per_s" in report and report.get("request_rate") is None:  # closed-loop runs only
            runs[variant_of(report)].append(report)
    return dict(runs)


def median(reports: list[dict], key: str) -> float | None:
    """Median of ``key`` over reports that have a value for it (None: none has)."""
    values = [r[key] for r in reports if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _is_default(v: Variant) -> bool:
    return v.workload == "synthetic" and v.prefix_caching and v.wait_ms == 0.0


def targets_table(runs: dict[Variant, list[dict]]) -> list[str]:
    """Throughput and latency per target and concurrency, engine ÷ target at the same concurrency."""
    rows = sorted((v for v in runs if _is_default(v)), key=lambda v: (v.concurrency, v.target, v.dtype))
    if not rows:
        return []
    tok = {v: median(runs[v], "output_tokens_per_s") for v in rows}
    lines = ["| target | dtype | concurrency | rounds | output tokens/s | TTFT p50 s | TTFT p99 s | TPOT p50 s "
             "| engine ÷ target |", "|---|---|---|---|---|---|---|---|---|"]
    for v in rows:
        engine = tok.get(v._replace(target="engine"))
        vs = _ratio(engine, tok[v]) if v.target != "engine" else "-"
        r = runs[v]
        lines.append(f"| {v.target} | {v.dtype} | {v.concurrency} | {len(r)} | {_fmt(tok[v], '.1f')} | "
                     f"{_fmt(median(r, 'ttft_p50_s'))} | {_fmt(median(r, 'ttft_p99_s'))} | "
                     f"{_fmt(median(r, 'tpot_p50_s'))} | {vs} |")
    return ["### Throughput by target (synthetic workload)", "", *lines, ""]


def mesh_table(runs: dict[Variant, list[dict]]) -> list[str]:
    """mesh / engine per concurrency and engine / hf-generate (hf-generate runs one request at a time)."""
    med: dict[tuple[str, int], float] = {}
    for v, reports in runs.items():
        if _is_default(v) and v.target in ("engine", "mesh", "hf-generate"):
            med[(v.target, v.concurrency)] = median(reports, "output_tokens_per_s")
    if not any(t in ("mesh", "hf-generate") for t, _ in med):
        return []
    hf = [m for (t, _), m in med.items() if t == "hf-generate"]
    lines = ["| concurrency | mesh / engine | engine / hf-generate |", "|---|---|---|"]
    for conc in sorted(c for t, c in med if t == "engine"):
        engine = med[("engine", conc)]
        lines.append(f"| {conc} | {_ratio(med.get(('mesh', conc)), engine)} | "
                     f"{_ratio(engine, hf[0]) if hf else '-'} |")
    return ["### Mesh and hf-generate against the engine", "", *lines, ""]


def prefix_caching_table(runs: dict[Variant, list[dict]]) -> list[str]:
    """Shared-prefix workload: each target with prefix caching on and off, and their ratios."""
    on = sorted((v for v in runs if v.workload == "shared-prefix" and v.prefix_caching and v.wait_ms == 0.0),
                key=lambda v: (v.target, v.concurrency))
    pairs = [(v, v._replace(prefix_caching=False)) for v in on if v._replace(prefix_caching=False) in runs]
    if not pairs:
        return []
    lines = ["| target | concurrency | prefix caching | rounds | output tokens/s | TTFT p50 s | TTFT p99 s "
             "| hit rate |", "|---|---|---|---|---|---|---|---|"]
    ratios = ["| target | concurrency | TTFT p50 off ÷ on | TTFT p99 off ÷ on | tokens/s on ÷ off |",
              "|---|---|---|---|---|"]
    for v_on, v_off in pairs:
        for v, label in ((v_on, "on"), (v_off, "off")):
            r = runs[v]
            lines.append(f"| {v.target} | {v.concurrency} | {label} | {len(r)} | "
                         f"{_fmt(median(r, 'output_tokens_per_s'), '.1f')} | {_fmt(median(r, 'ttft_p50_s'))} | "
                         f"{_fmt(median(r, 'ttft_p99_s'))} | {_fmt(median(r, 'prefix_cache_hit_rate'), '.1%')} |")
        a, b = runs[v_on], runs[v_off]
        ratios.append(f"| {v_on.target} | {v_on.concurrency} | "
                      f"{_ratio(median(b, 'ttft_p50_s'), median(a, 'ttft_p50_s'))} | "
                      f"{_ratio(median(b, 'ttft_p99_s'), median(a, 'ttft_p99_s'))} | "
                      f"{_ratio(median(a, 'output_tokens_per_s'), median(b, 'output_tokens_per_s'))} |")
    return ["### Prefix caching on the shared-prefix workload", "", *lines, "", *ratios, ""]


def batch_wait_table(runs: dict[Variant, list[dict]]) -> list[str]:
    """Each ``--max-batch-wait-ms`` against wait 0 of the same workload, target and concurrency."""
    waited = {v._replace(wait_ms=0.0) for v in runs if v.wait_ms > 0}
    groups = sorted(g for g in waited if g in runs)
    if not groups:
        return []
    lines = ["| target | workload | concurrency | max batch wait ms | rounds | output tokens/s | TTFT p50 s "
             "| TTFT p99 s | tokens/s ÷ wait 0 | TTFT p50 ÷ wait 0 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for base in groups:
        b = runs[base]
        for v in sorted((v for v in runs if v._replace(wait_ms=0.0) == base), key=lambda v: v.wait_ms):
            r = runs[v]
            lines.append(f"| {v.target} | {v.workload} | {v.concurrency} | {v.wait_ms:g} | {len(r)} | "
                         f"{_fmt(median(r, 'output_tokens_per_s'), '.1f')} | {_fmt(median(r, 'ttft_p50_s'))} | "
                         f"{_fmt(median(r, 'ttft_p99_s'))} | "
                         f"{_ratio(median(r, 'output_tokens_per_s'), median(b, 'output_tokens_per_s'))} | "
                         f"{_ratio(median(r, 'ttft_p50_s'), median(b, 'ttft_p50_s'))} |")
    return ["### Dynamic batching wait (engine flag --max-batch-wait-ms)", "", *lines, ""]


def _kv(reports: list[dict], field: str) -> float | None:
    values = [r["kv_cache_utilization"][field] for r in reports
              if r.get("kv_cache_utilization") and r["kv_cache_utilization"][field] is not None]
    return statistics.median(values) if values else None


def kv_table(runs: dict[Variant, list[dict]]) -> list[str]:
    """KV cache use of every variant with engine counters."""
    rows = sorted((v for v, r in runs.items() if any(x.get("kv_capacity") for x in r)))
    if not rows:
        return []
    lines = ["| target | workload | concurrency | prefix caching | wait ms | KV utilization mean | max "
             "| requests running max | fit reserving max_model_len | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in rows:
        r = runs[v]
        reserved = median([x["kv_capacity"] for x in r if x.get("kv_capacity")], "requests_fit_reserved")
        lines.append(f"| {v.target} | {v.workload} | {v.concurrency} | {'on' if v.prefix_caching else 'off'} | "
                     f"{v.wait_ms:g} | {_fmt(_kv(r, 'mean'), '.1%')} | {_fmt(_kv(r, 'max'), '.1%')} | "
                     f"{_fmt(median(r, 'max_num_running'), 'g')} | {_fmt(reserved, 'g')} | "
                     f"{_fmt(median(r, 'num_preemptions'), 'g')} |")
    return ["### KV cache", "", *lines, ""]


def summarise(folder: Path) -> str:
    """The Markdown summary of every ``*.json`` report directly in ``folder``."""
    runs = load_runs(folder)
    lines: list[str] = []
    for table in (targets_table, mesh_table, prefix_caching_table, batch_wait_table, kv_table):
        lines += table(runs)
    return "\n".join(lines) + "\n"


def report_folders(root: Path) -> list[Path]:
    """``root`` and every folder below it that holds a ``*.json`` file, parents first."""
    folders = {p.parent for p in root.rglob("*.json")} | {root}
    return sorted(folders, key=lambda p: (len(p.parts), str(p)))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "reports")
    out = []
    for folder in report_folders(root):
        text = summarise(folder)
        if text.strip():
            (folder / "summary.md").write_text(text)
            out.append(f"## {folder}\n\n{text}")
    print("\n".join(out) if out else f"no reports in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
