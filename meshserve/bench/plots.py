"""The PNG plots of a sweep report (matplotlib, Agg backend: no display needed).

Four files under ``plots/``, one line per system (the target, then each baseline):

* ``throughput_vs_concurrency.png`` (closed-loop sweeps) or
  ``throughput_vs_rate.png`` (open-loop sweeps): output tokens/s against the load;
* ``ttft_cdf.png`` and ``tpot_cdf.png``: the empirical CDF of every request's
  TTFT / TPOT (ms), one curve per system and point (a colour per point, a line
  style per system: solid for the target, dashed, dotted, dash-dotted for the
  baselines in run order);
* ``latency_vs_load.png``: e2e latency p50 (solid) and p99 (dashed) against the load.

A rate of ``inf`` (every request at once) is drawn one step right of the largest
finite rate, labelled ``inf``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PLOT_NAMES = ("ttft_cdf.png", "tpot_cdf.png", "latency_vs_load.png")
LINE_STYLES = ("-", "--", ":", "-.")  # the target, then the baselines in run order


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; also on machines without a display
    import matplotlib.pyplot as plt

    return plt


def systems(doc: dict, point: dict) -> list[tuple[str, dict]]:
    """``(name, report)`` of the target, then of each baseline in run order, at ``point``
    of the sweep report ``doc`` (``meshserve.bench.sweep.run_sweep``)."""
    return [(doc["target"], point["target"])] + [(name, point["baselines"][name]) for name in doc["baselines"]]


def _loads(doc: dict) -> tuple[list[float], list[str], str]:
    """x positions, tick labels and axis label of the sweep's loads."""
    over, values = doc["sweep"]["over"], doc["sweep"]["values"]
    labels = [f"{v:g}" if not isinstance(v, str) else v for v in values]
    finite = [float(v) for v in values if v != "inf"]
    step = max(finite) * 0.25 if finite else 1.0
    xs = [float(v) if v != "inf" else (max(finite) if finite else 0.0) + step for v in values]
    return xs, labels, "concurrency (requests in flight)" if over == "concurrency" else "request rate (requests/s)"


def _finish(ax, fig, **legend) -> None:
    ax.grid(alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()


def _line_plot(doc: dict, title: str, ylabel: str, series: list[tuple[str, str, str]]):
    """Lines of report keys against the load, one colour per system: ``series`` holds
    ``(key, label suffix, line style)``; the figure."""
    plt = _pyplot()
    xs, labels, xlabel = _loads(doc)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for s, (name, _) in enumerate(systems(doc, doc["points"][0])):
        for key, suffix, style in series:
            ys = [systems(doc, p)[s][1][key] for p in doc["points"]]
            ax.plot(xs, ys, style, marker="o", color=f"C{s % 10}", label=f"{name}{suffix}")
    ax.set_xticks(xs, labels)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    _finish(ax, fig)
    return fig


def _cdf_plot(doc: dict, key: str, title: str):
    """The empirical CDF of each request's ``key`` (seconds, drawn in ms) per system and point; the figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, p in enumerate(doc["points"]):  # one colour per point, one line style per system
        load = f"c{p['concurrency']}" if p["request_rate"] is None else f"{p['request_rate']} req/s"
        for s, (name, report) in enumerate(systems(doc, p)):
            values = np.sort([r[key] * 1000.0 for r in report["requests"] if key != "tpot_s" or r["output_len"] > 1])
            if values.size:
                ax.step(np.concatenate([values[:1], values]), np.arange(values.size + 1) / values.size,
                        where="post", label=f"{name} {load}", color=f"C{i % 10}",
                        linestyle=LINE_STYLES[s % len(LINE_STYLES)])
    ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    _finish(ax, fig, fontsize="small")
    return fig


def sweep_figures(doc: dict) -> dict[str, object]:
    """The figures of the sweep report ``doc`` (``meshserve.bench.sweep.run_sweep``), by file name
    in the module doc's order: matplotlib ``Figure`` objects, each line labelled with its system
    (and point or percentile); the caller closes them."""
    over = doc["sweep"]["over"]
    throughput = "throughput_vs_concurrency.png" if over == "concurrency" else "throughput_vs_rate.png"
    return {
        throughput: _line_plot(doc, "Output throughput", "output tokens/s", [("output_tokens_per_s", "", "-")]),
        "ttft_cdf.png": _cdf_plot(doc, "ttft_s", "TTFT (submit → first token)"),
        "tpot_cdf.png": _cdf_plot(doc, "tpot_s", "TPOT (mean gap between output tokens)"),
        "latency_vs_load.png": _line_plot(doc, "End-to-end latency", "seconds",
                                          [("e2e_p50_s", " p50", "-"), ("e2e_p99_s", " p99", "--")]),
    }


def write_plots(doc: dict, folder: str | Path) -> list[Path]:
    """Draws the sweep report ``doc`` (``meshserve.bench.sweep.run_sweep``) into ``folder``
    (created) as PNGs at 100 dpi; returns the files written, in the module doc's order."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, fig in sweep_figures(doc).items():
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        files.append(folder / name)
    return files
