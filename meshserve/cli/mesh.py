"""``meshserve up`` (the whole mesh on loopback, one process per service) and ``meshserve demo``.

``up`` turns its flags into a ``meshserve.cli.mesh_config.MeshConfig`` (``mesh_config``)
and runs the mesh until it is stopped (``meshserve.cli.run_mesh``). The launcher
(gRPC) and the demo are imported when a command runs, so that ``meshserve --help``
stays fast.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from meshserve.cli.options import (ChatTemplateOpt, ExecutorCapacityOpt, InsecureOpt, OtlpOpt, PlannerIntervalOpt,
                                   PlannerSeasonOpt, ResultCacheSizeOpt, SampleOpt, ScaleDownCooldownOpt,
                                   ServedModelNameOpt, TaskStoreOpt, TLSCAOpt, TLSCertOpt, TLSKeyOpt, TokenizerOpt,
                                   TracesOpt, export_trace_settings, parse_bytes, show_model_conversion,
                                   tls_settings)
from meshserve.cli.run_mesh import run_mesh
from meshserve.cli.store_check import STORE_ENV

if TYPE_CHECKING:
    from meshserve.cli.mesh_config import MeshConfig


def service_flags(**values) -> list[str]:
    """Command-line flags of the values given: ``name=value`` → ``--name value`` (``_`` as
    ``-``), None left out, True a bare flag, a list or tuple one flag per item."""
    out: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is True:
                out.append(flag)
            elif v is not None and v is not False:
                out += [flag, str(v)]
    return out


def mesh_config(port: int, executors: int, model: str, dtype: str | None, kv_cache_memory: str, extra: list[str],
                tenants: Optional[str], log_dir: Optional[str], kvstore_memory: Optional[str] = None,
                metrics: bool = False, result_cache_size: int = 0, task_store: str = "memory",
                tls_dir: Optional[str] = None, tls_files: Optional[tuple[str, str, str]] = None,
                http_port: int | None = None, scheduler_args: list[str] | None = None,
                gateway_args: list[str] | None = None, kvstore_args: list[str] | None = None,
                cpu_affinity: bool = False) -> MeshConfig:
    """The ``MeshConfig`` of ``up``'s flags.

    ``dtype`` (None: the executor's default), ``kv_cache_memory`` (bytes, e.g. ``1GiB``)
    and ``extra`` become the executors' flags; ``result_cache_size`` (entries),
    ``task_store`` (``memory`` or a ``redis://`` URL) and ``http_port`` (None: no HTTP)
    go to the gateway; ``kvstore_memory`` None starts no kvstore; ``scheduler_args``,
    ``gateway_args`` and ``kvstore_args`` are further flags of those services.
    ``tls_dir`` (role certificates) or ``tls_files`` (cert, key, CA): mutual TLS;
    neither: plaintext on loopback. ``cpu_affinity``: pin the executors and the other
    services to cores of their own (``MeshConfig.cpu_affinity``).
    """
    from meshserve.cli.mesh_config import MeshConfig

    args = [*service_flags(dtype=dtype), "--kv-cache-memory", kv_cache_memory, *extra]
    return MeshConfig(port=port, executors=executors, model=model, executor_args=args, tenants_file=tenants,
                      log_dir=Path(log_dir) if log_dir else None, kvstore_memory=kvstore_memory, metrics=metrics,
                      result_cache_size=result_cache_size, task_store=task_store,
                      tls_dir=Path(tls_dir) if tls_dir else None, tls_files=tls_files, http_port=http_port,
                      scheduler_args=list(scheduler_args or ()), gateway_args=list(gateway_args or ()),
                      kvstore_args=list(kvstore_args or ()), cpu_affinity=cpu_affinity)


def parallel_args(tensor_parallel_size: int, pipeline_parallel_size: int) -> list[str]:
    """The executors' parallel flags (none at 1 × 1)."""
    args = []
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size != 1:
        args += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    return args


_FOR = "Passed to the {}."


AUTOSCALE_ONLY = {"planner_interval_s": "--planner-interval-s", "planner_season_s": "--planner-season-s",
                  "executor_capacity": "--executor-capacity-tokens-per-s",
                  "scale_down_cooldown_s": "--scale-down-cooldown-s", "start_budget_s": "--start-budget-s"}
"""``up``'s parameters that only ``--autoscale`` reads → their flags."""


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether ``up``'s parameter ``name`` was given on its command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _given_again(ctx: typer.Context, model: str, dtype: str | None, kv_cache_memory: str, result_cache_size: int,
                 task_store: str, kvstore_memory: str) -> dict[str, list[str]]:
    """Service → the flags ``up`` passes ahead of a ``--config`` file's (its defaults, which
    the file overrides) that were given on its command line: passed again after the
    file's, so that they win over it like every other flag of ``up`` (only with a file:
    without one nothing comes between). A store's variable (``MESHSERVE_TASK_STORE``,
    ``MESHSERVE_RESULT_CACHE``) counts as given: flag, then variable, then file."""
    again: dict[str, list[str]] = {"executor": [], "gateway": [], "kvstore": []}
    for name, value, flag, services in (
            ("model", model, "--model", ("executor", "gateway")), ("dtype", dtype, "--dtype", ("executor",)),
            ("kv_cache_memory", kv_cache_memory, "--kv-cache-memory", ("executor",)),
            ("result_cache_size", result_cache_size, "--result-cache-size", ("gateway",)),
            ("task_store", task_store, "--task-store", ("gateway",)),
            ("kvstore_memory", kvstore_memory, "--memory", ("kvstore",))):
        if _given(ctx, name) and value is not None:
            for service in services:
                again[service] += [flag, str(value)]
    result_cache = os.environ.get(STORE_ENV["--result-cache"])
    if result_cache:  # up has no --result-cache flag; its variable wins over the file, as MESHSERVE_TASK_STORE does
        again["gateway"] += ["--result-cache", result_cache]
    return again


def _check_autoscale_only(ctx: typer.Context, autoscale: str | None) -> None:
    """Raises ``typer.BadParameter`` for an autoscaling flag given without ``--autoscale``
    (it would be ignored silently)."""
    if autoscale is not None:
        return
    for name, flag in AUTOSCALE_ONLY.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source.name == "COMMANDLINE":  # not the default or a config
            raise typer.BadParameter(f"{flag} applies only with --autoscale MIN..MAX")


def up(
    ctx: typer.Context,
    port: int = typer.Option(50051, min=0, max=65535,
                             help="Public gRPC port of the gateway (0: a free one, chosen when the gateway starts; "
                                  "HTTP stays on --http-port)."),
    http_port: Optional[int] = typer.Option(8000, "--http-port", min=0, max=65535,
                                            help="The gateway's OpenAI-compatible HTTP port (0: a free one)."),
    executors: int = typer.Option(1, min=1, help="Number of executor processes."),
    model: str = typer.Option("default", help="Model alias, .gguf file, safetensors folder or Hugging Face id "
                              "(from the local Hugging Face cache)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Revision of a Hugging Face model id (default: "
                                           "main). " + _FOR.format("executors and the gateway")),
    tokenizer: Optional[str] = TokenizerOpt,
    chat_template: Optional[str] = ChatTemplateOpt,
    served_model_name: Optional[list[str]] = ServedModelNameOpt,
    dtype: Optional[str] = typer.Option(None, help="auto, float32, bfloat16 or float16 (default auto). "
                                        + _FOR.format("executors")),
    device: Optional[str] = typer.Option(None, help="torch device: cpu, cuda, cuda:1… (default cpu). "
                                         + _FOR.format("executors")),
    kv_cache_memory: str = typer.Option("1GiB", "--kv-cache-memory", help="KV cache budget of each executor."),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1, help="Tokens per KV block (default 16). "
                                             + _FOR.format("executors and the gateway")),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", min=1, help="Most requests in an executor's "
                                               "running batch (default 64)."),
    max_batch_wait_ms: Optional[float] = typer.Option(None, "--max-batch-wait-ms", min=0.0,
                                                      help="Hold a new prefill up to this long to batch it "
                                                      "(default 0). " + _FOR.format("executors")),
    short_prefill_tokens: Optional[int] = typer.Option(None, "--short-prefill-tokens", min=0,
                                                       help="Short prefills first up to this many tokens (default "
                                                            "64; 0: off). " + _FOR.format("executors")),
    prefill_order: Optional[str] = typer.Option(None, "--prefill-order",
                                                help="Order of waiting prompts within a priority: shortest or "
                                                     "arrival (default shortest). " + _FOR.format("executors")),
    long_prefill_token_threshold: Optional[int] = typer.Option(None, "--long-prefill-token-threshold", min=0,
                                                               help="Most prompt tokens one request computes in a "
                                                                    "step (default 0: no cap). "
                                                                    + _FOR.format("executors")),
    queue_policy: Optional[str] = typer.Option(None, "--queue-policy", help="fcfs, priority or sjf (default fcfs). "
                                               + _FOR.format("scheduler")),
    pools: Optional[str] = typer.Option(None, "--pools", help="Pools TOML file (default: any pool). "
                                        + _FOR.format("scheduler")),
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file (keys for the gateway, KV quotas for the "
                                          "scheduler; default: open, tenant 'default')."),
    config: Optional[str] = typer.Option(None, "--config", help="Mesh config TOML: per-service flags in "
                                         "[scheduler], [executor], [gateway], [kvstore] sections (a flag given to "
                                         "up wins over the file; the file over up's defaults)."),
    log_dir: Optional[str] = typer.Option(None, help="Write each service's log here instead of the terminal."),
    kvstore: bool = typer.Option(False, "--kvstore", help="Start one kvstore and connect every executor to it."),
    kvstore_memory: str = typer.Option("1GiB", "--kvstore-memory", help="Memory tier budget of that kvstore."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                             help="Ranks (processes; GPUs on CUDA) each executor's layers are "
                                                  "sharded over."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", min=1,
                                               help="Pipeline stages each executor's layers are split into."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="Give every service a free port for its "
                                 "Prometheus /metrics endpoint and print them."),
    result_cache_size: int = ResultCacheSizeOpt,
    task_store: str = TaskStoreOpt,
    autoscale: Optional[str] = typer.Option(None, "--autoscale", help="MIN..MAX: start and drain executor processes "
                                            "as the scheduler's planner says (--executors is then MIN)."),
    planner_interval_s: float = PlannerIntervalOpt,
    planner_season_s: float = PlannerSeasonOpt,
    executor_capacity: float = ExecutorCapacityOpt,
    scale_down_cooldown_s: float = ScaleDownCooldownOpt,
    start_budget_s: float = typer.Option(300.0, "--start-budget-s", min=1.0, help="With --autoscale: an executor "
                                         "not ready this long after its start is killed and replaced, and a "
                                         "request finding no executor (MIN 0: scale to zero) waits this long."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    tls_dir: Optional[str] = typer.Option(None, "--tls-dir", help="Run the mesh over mutual TLS with the role "
                                          "certificates in this directory (made there by `meshserve certs` "
                                          "when it holds none). Default: plaintext on loopback."),
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
    cpu_affinity: bool = typer.Option(True, "--cpu-affinity/--no-cpu-affinity",
                                      help="Pin each executor to cores of its own and the other services to the "
                                           "cores left, when the cores allow (every executor's threads plus one)."),
) -> None:
    """Start the whole mesh on loopback; Ctrl-C stops it cleanly (plaintext unless --tls-dir or --tls-*)."""
    from gateway.task_store_registry import task_store_kind
    from meshserve.cli import processes
    from meshserve.cli.launcher import Mesh
    from meshserve.cli.mesh_file import read_mesh_file

    _check_autoscale_only(ctx, autoscale)
    show_model_conversion()  # check_parallel_layout below resolves the model: a first use converts it here
    try:  # checked before any service starts: a usage error, exit code 2
        task_store_kind(task_store)
        cfg = processes.engine_config(model, dtype or "auto", kv_cache_memory, block_size=block_size or 16,
                                      max_num_seqs=max_num_seqs or 64, max_num_batched_tokens=2048,
                                      no_chunked_prefill=False, max_model_len=None, num_threads=None,
                                      max_batch_wait_ms=max_batch_wait_ms or 0.0, device=device or "cpu",
                                      tensor_parallel_size=tensor_parallel_size,
                                      pipeline_parallel_size=pipeline_parallel_size,
                                      long_prefill_token_threshold=long_prefill_token_threshold or 0,
                                      short_prefill_tokens=short_prefill_tokens,
                                      prefill_order=prefill_order)  # as each executor checks them
        processes.check_parallel_layout(cfg.model, revision, tensor_parallel_size, pipeline_parallel_size)
        if queue_policy is not None or tenants or pools:  # as the scheduler reads them (the gateway reads tenants too)
            processes.scheduler_config(queue_policy or "fcfs", tenants_file=tenants, pools_file=pools)
        parse_bytes(kvstore_memory)
        file_args = read_mesh_file(config) if config else {s: [] for s in ("scheduler", "executor", "gateway",
                                                                            "kvstore")}
        scale = None
        if autoscale is not None:
            from meshserve.cli.autoscale import parse_range
            from scheduler.planner import PlannerConfig

            scale = parse_range(autoscale)
            if not math.isfinite(start_budget_s):
                raise ValueError(f"--start-budget-s must be a finite number of seconds, got {start_budget_s}")
            executors, metrics = scale[0], True  # the planner's metric is read from /metrics
            planner_args = service_flags(planner_interval_s=planner_interval_s, planner_season_s=planner_season_s,
                                         min_executors=scale[0], max_executors=scale[1],
                                         executor_capacity_tokens_per_s=executor_capacity,
                                         scale_down_cooldown_s=scale_down_cooldown_s, start_budget_s=start_budget_s)
            PlannerConfig(interval_s=planner_interval_s, season_s=planner_season_s, min_executors=scale[0],
                          max_executors=scale[1], capacity_tokens_per_s=executor_capacity,
                          scale_down_cooldown_s=scale_down_cooldown_s)  # checked here: a usage error
    except (ValueError, OSError) as exc:  # OSError: a file named by a flag that cannot be read
        raise typer.BadParameter(str(exc)) from None
    tls_files = None
    if tls_cert or tls_key or tls_ca or insecure:
        if tls_dir:
            raise typer.BadParameter("--tls-dir cannot be combined with --tls-cert/--tls-key/--tls-ca/--insecure")
        tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)
        tls_files = (tls.cert, tls.key, tls.ca) if tls.enabled else None
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    executor_flags = service_flags(device=device, block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_batch_wait_ms=max_batch_wait_ms, revision=revision,
                                   short_prefill_tokens=short_prefill_tokens, prefill_order=prefill_order,
                                   long_prefill_token_threshold=long_prefill_token_threshold)
    executor_flags += parallel_args(tensor_parallel_size, pipeline_parallel_size)
    gateway_flags = service_flags(revision=revision, tokenizer=tokenizer, chat_template=chat_template,
                                  served_model_name=served_model_name)
    again = _given_again(ctx, model, dtype, kv_cache_memory, result_cache_size, task_store, kvstore_memory) \
        if config else {"executor": [], "gateway": [], "kvstore": []}
    executor_flags += again["executor"]
    gateway_flags += again["gateway"]
    config = mesh_config(port, executors, model, dtype, kv_cache_memory, [*file_args["executor"], *executor_flags],
                         tenants, log_dir, kvstore_memory if kvstore else None, metrics,
                         result_cache_size=result_cache_size, task_store=task_store,
                         tls_dir=tls_dir, tls_files=tls_files,
                         http_port=http_port if _given(ctx, "http_port") or "--http-port" not in file_args["gateway"]
                         else None,  # up's default yields to the file's [gateway] http-port
                         scheduler_args=[*file_args["scheduler"], *service_flags(queue_policy=queue_policy,
                                                                                 pools=pools)],
                         gateway_args=[*file_args["gateway"], *gateway_flags],
                         kvstore_args=[*file_args["kvstore"], *again["kvstore"]], cpu_affinity=cpu_affinity)
    if scale is not None:
        config.scheduler_args += planner_args
        config.autoscale = scale
        config.start_budget_s = start_budget_s  # the executors' start budget; the services keep their own timeout
    run_mesh(Mesh(config))


def demo(
    port: int = typer.Option(0, min=0, max=65535, help="Gateway port (0: a free one)."),
    executors: int = typer.Option(1, min=1, help="Number of executor processes."),
    max_tokens: int = typer.Option(96, help="Tokens per answer."),
) -> None:
    """Start the mesh, stream 8 concurrent chat answers, print a summary, stop."""
    from meshserve.cli.demo import run_demo

    sys.exit(run_demo(port, executors, max_tokens))
