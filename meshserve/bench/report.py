"""The benchmark's report: one JSON object, and a short table for people.

Definitions (the ones vLLM's ``benchmark_serving`` uses):

* ``output_tokens_per_s`` = total output tokens / ``wall_s``, where ``wall_s``
  runs from the first submit to the last finish of the measured requests
  (warm-up excluded).
* TTFT: submit → first output token, as the benchmark process saw it.
* TPOT: mean gap between output tokens after the first, per request:
  ``(t_last - t_first) / (n - 1)``; requests with one token have none and are left
  out of the TPOT percentiles.
* e2e: submit → last token / end of the call.
* ``mode``: "closed-loop" (``concurrency`` workers) or "open-loop" (Poisson
  arrivals at ``request_rate`` requests/s, "inf": all at once; ``concurrency`` is
  null).
* Engine figures (``kv_cache_utilization``, ``prefix_cache_hit_rate``,
  ``num_preemptions``, ``max_num_running``, ``kv_capacity``): see
  ``meshserve.bench.engine_stats``; None for targets without engine counters.
* ``cpu_wait``: per process that runs the system's engine (``engine``, a launched
  mesh's ``executor-N``, ``vllm``), its busiest thread's CPU seconds and seconds
  waiting for a CPU over the run (``meshserve.bench.cpu_wait``); {} where unknown
  (a mesh at ``--addr``, the transformers targets, not Linux).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

from meshserve.bench.config import BenchConfig
from meshserve.bench.cpu_wait import warnings as cpu_wait_warnings
from meshserve.bench.engine_stats import NULL_METRICS
from meshserve.bench.loop import RequestResult
from meshserve.bench.stats import percentile
from meshserve.bench.workload import Workload

# How each transformers target's TTFT is taken (the engine targets time token arrival).
TTFT_METHODS = {
    "hf-generate": "streamer: time the first generated token reaches a transformers streamer",
    "hf-static": "batch: every request of a static batch is submitted when the batch starts and gets the "
                 "batch's first-token time (streamer); e2e ends when the whole batch returns",
    "hf-continuous": "streaming: arrival of each token through ContinuousBatchingManager.register_result_handler "
                     "(add_request(streaming=True))",
}


__all__ = ["build_report", "format_table", "write_report"]


def _latency(name: str, values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of ``values`` (seconds) under ``{name}_p50_s``…; 0.0 when empty."""
    xs = list(values)
    stats = {f"{name}_p{q}_s": percentile(xs, q, empty=0.0) for q in (50, 90, 99)}
    return {**stats, f"{name}_mean_s": statistics.fmean(xs) if xs else 0.0}


def build_report(
    config: BenchConfig, workload: Workload, results: Sequence[RequestResult], wall_s: float, target_facts: dict,
    engine_metrics: dict | None = None,
) -> dict:
    """The report of one measured run.

    Args:
        config: the run's configuration.
        workload: the measured requests (for the length medians).
        results: one per measured request, in any order.
        wall_s: seconds of the measured run.
        target_facts: ``Target.describe()`` (its ``dtype`` overrides the asked one).
        engine_metrics: ``StatsSampler.metrics()``; None: every engine figure is None.

    Raises:
        ValueError: ``results`` and ``workload`` differ in size.
    """
    if len(results) != len(workload.requests):
        raise ValueError(f"{len(results)} results for {len(workload.requests)} requests")
    spec = workload.spec
    total_out = sum(r.output_len for r in results)
    report = {
        "target": config.target,
        "workload": spec.kind,
        "model": config.model,
        "dtype": config.dtype,
        "concurrency": config.effective_concurrency,
        "mode": "closed-loop" if config.request_rate is None else "open-loop",
        "request_rate": json_rate(config.request_rate),
        "num_requests": len(results),
        "seed": spec.seed,
        "warmup": config.warmup,
        "wall_s": wall_s,
        "total_output_tokens": total_out,
        "total_prompt_tokens": sum(r.prompt_len for r in results),
        "output_tokens_per_s": total_out / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(results) / wall_s if wall_s > 0 else 0.0,
        **_latency("ttft", [r.ttft_s for r in results]),
        **_latency("tpot", [r.tpot_s for r in results if r.output_len > 1]),
        **_latency("e2e", [r.e2e_s for r in results]),
        "prompt_len_median": statistics.median(workload.prompt_lens),
        "output_len_median": statistics.median(workload.output_lens),
        "prompt_len_median_target": spec.prompt_len_median,
        "output_len_median_target": spec.output_len_median,
        **(engine_metrics if engine_metrics is not None else NULL_METRICS),
        **target_facts,
    }
    if spec.kind == "shared-prefix":
        report.update(shared_prefix_len=spec.shared_prefix_len, shared_fraction=spec.shared_fraction)
    if config.target in TTFT_METHODS:
        report["ttft_method"] = TTFT_METHODS[config.target]
    report["requests"] = [{"request_id": r.request_id, "prompt_len": r.prompt_len, "output_len": r.output_len,
                           "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s} for r in results]
    return report


def format_table(report: dict) -> str:
    """A few lines summarising ``report`` for the terminal."""
    ms = 1000.0
    rows = [
        ("target", f"{report['target']} ({report['dtype']}, {_load(report)}, "
                   f"{report.get('workload', 'synthetic')} workload)"),
        ("requests", f"{report['num_requests']} (seed {report['seed']}, warm-up {report['warmup']})"),
        ("prompt / output median", f"{report['prompt_len_median']:g} / {report['output_len_median']:g} tokens"),
        ("wall", f"{report['wall_s']:.2f} s"),
        ("output tokens", f"{report['total_output_tokens']} ({report['output_tokens_per_s']:.1f} tokens/s)"),
        ("TTFT p50 / p99", f"{report['ttft_p50_s'] * ms:.1f} / {report['ttft_p99_s'] * ms:.1f} ms"),
        ("TPOT p50 / p99", f"{report['tpot_p50_s'] * ms:.1f} / {report['tpot_p99_s'] * ms:.1f} ms"),
        ("e2e p50 / p99", f"{report['e2e_p50_s']:.2f} / {report['e2e_p99_s']:.2f} s"),
    ]
    rows += _engine_rows(report)
    if report.get("cpus"):  # a launched mesh pinned to cores (--cpu-affinity)
        rows.append(("cores", ", ".join(f"{name} {cpus}" for name, cpus in report["cpus"].items())))
    elif report.get("cpu_note"):  # a launched mesh that could not be pinned, and why
        rows.append(("cores", report["cpu_note"]))
    if report.get("cpu_wait"):  # the system's busiest thread: its CPU and its wait for one (meshserve.bench.cpu_wait)
        rows.append(("busiest thread CPU / waiting", ", ".join(
            f"{name} {w['busiest_thread_cpu_s']:.1f} / {w['run_queue_wait_s']:.1f} s"
            for name, w in report["cpu_wait"].items())))
        rows += [("warning", line) for line in cpu_wait_warnings(report["cpu_wait"])]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _load(report: dict) -> str:
    """"concurrency 8" (closed loop) or "Poisson 2 requests/s" (open loop)."""
    rate = report.get("request_rate")
    if rate is None:
        return f"concurrency {report['concurrency']}"
    return "every request at once" if rate == "inf" else f"Poisson {rate:g} requests/s"


def json_rate(rate: float | None) -> float | str | None:
    """The request rate as JSON holds it: "inf" for every request at once (JSON has no infinity)."""
    return "inf" if rate == float("inf") else rate


def _engine_rows(report: dict) -> list[tuple[str, str]]:
    """Table rows of the engine figures that are known."""
    rows = []
    kv, cap = report.get("kv_cache_utilization"), report.get("kv_capacity")
    if kv and kv["mean"] is not None:
        rows.append(("KV utilization mean / max", f"{kv['mean']:.1%} / {kv['max']:.1%} ({kv['num_samples']} samples)"))
    if cap:
        rows.append(("requests running (max)", f"{report['max_num_running']} (reserving max_model_len "
                                                f"{cap['max_model_len']}: {cap['requests_fit_reserved']} fit)"))
    if report.get("prefix_cache_hit_rate") is not None:
        rows.append(("prefix cache hit rate", f"{report['prefix_cache_hit_rate']:.1%} "
                                              f"({report['prefix_cache_hit_tokens']} / "
                                              f"{report['prefix_cache_queried_tokens']} tokens)"))
    if report.get("num_preemptions") is not None:
        rows.append(("preemptions", str(report["num_preemptions"])))
    return rows


def write_report(report: dict, path: str | Path) -> None:
    """Writes ``report`` as indented JSON (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
