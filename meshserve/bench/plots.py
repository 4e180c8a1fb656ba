"""The PNG plots of a sweep report (matplotlib, Agg backend: no display needed).

Four files under ``plots/``, one line per system (the target, the baseline):

* ``throughput_vs_concurrency.png`` (closed-loop sweeps) or
  ``throughput_vs_rate.png`` (open-loop sweeps): output tokens/s against the load;
* ``ttft_cdf.png`` and ``tpot_cdf.png``: the empirical CDF of every request's
  TTFT / TPOT (ms), one curve per system and point;
* ``latency_vs_load.png``: e2e latency p50 (solid) and p99 (dashed) against the load.

A rate of ``inf`` (every request at once) is drawn one step right of the largest
finite rate, labelled ``inf``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PLOT_NAMES = ("ttft_cdf.png", "tpot_cdf.png", "latency_vs_load.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; also on machines without a display
    import matplotlib.pyplot as plt

    return plt


def _systems(doc: dict) -> list[tuple[str, str]]:
    """``(role, name)`` of the target and, when present, the baseline."""
    return [("target", doc["target"])] + ([("baseline", doc["baseline"])] if doc.get("baseline") else [])


def _loads(doc: dict) -> tuple[list[float], list[str], str]:
    """x positions, tick labels and axis label of the sweep's loads."""
    over, values = doc["sweep"]["over"], doc["sweep"]["values"]
    labels = [f"{v:g}" if not isinstance(v, str) else v for v in values]
    finite = [float(v) for v in values if v != "inf"]
    step = max(finite) * 0.25 if finite else 1.0
    xs = [float(v) if v != "inf" else (max(finite) if finite else 0.0) + step for v in values]
    return xs, labels, "concurrency (requests in flight)" if over == "concurrency" else "request rate (requests/s)"


def _line_plot(doc: dict, path: Path, title: str, ylabel: str, series: list[tuple[str, str, str]]) -> None:
    """Lines of report keys against the load: ``series`` holds ``(key, label suffix, line style)``."""
    plt = _pyplot()
    xs, labels, xlabel = _loads(doc)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for role, name in _systems(doc):
        color = None
        for key, suffix, style in series:
            ys = [p[role][key] for p in doc["points"]]
            (line,) = ax.plot(xs, ys, style, marker="o", color=color, label=f"{name}{suffix}")
            color = line.get_color()
    ax.set_xticks(xs, labels)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf_plot(doc: dict, path: Path, key: str, title: str) -> None:
    """The empirical CDF of each request's ``key`` (seconds, drawn in ms) per system and point."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for role, name in _systems(doc):
        for i, p in enumerate(doc["points"]):  # one colour per point; solid: target, dashed: baseline
            values = np.sort([r[key] * 1000.0 for r in p[role]["requests"] if key != "tpot_s" or r["output_len"] > 1])
            if values.size:
                load = f"c{p['concurrency']}" if p["request_rate"] is None else f"{p['request_rate']} req/s"
                ax.step(np.concatenate([values[:1], values]), np.arange(values.size + 1) / values.size,
                        where="post", label=f"{name} {load}", color=f"C{i % 10}",
                        linestyle="-" if role == "target" else "--")
    ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(doc: dict, folder: str | Path) -> list[Path]:
    """Draws the sweep report ``doc`` (``meshserve.bench.sweep.run_sweep``) into ``folder``
    (created); returns the files written, in the module doc's order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    over = doc["sweep"]["over"]
    throughput = folder / ("throughput_vs_concurrency.png" if over == "concurrency" else "throughput_vs_rate.png")
    _line_plot(doc, throughput, "Output throughput", "output tokens/s", [("output_tokens_per_s", "", "-")])
    _cdf_plot(doc, folder / "ttft_cdf.png", "ttft_s", "TTFT (submit → first token)")
    _cdf_plot(doc, folder / "tpot_cdf.png", "tpot_s", "TPOT (mean gap between output tokens)")
    _line_plot(doc, folder / "latency_vs_load.png", "End-to-end latency", "seconds",
               [("e2e_p50_s", " p50", "-"), ("e2e_p99_s", " p99", "--")])
    return [throughput, *(folder / n for n in PLOT_NAMES)]
