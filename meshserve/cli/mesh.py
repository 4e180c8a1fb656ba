"""``meshserve up`` (the whole mesh on loopback, one process per service) and ``meshserve demo``.

``up`` turns its flags into a ``meshserve.cli.launcher.MeshConfig`` (``mesh_config``),
starts the mesh and waits: Ctrl-C or SIGTERM stops every service; a service that
exits stops the rest and ``up`` exits with code 1. The launcher (gRPC) and the demo
are imported when a command runs, so that ``meshserve --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from meshserve.cli.options import (OtlpOpt, ResultCacheSizeOpt, SampleOpt, TaskStoreOpt, TracesOpt, parse_bytes,
                                   export_trace_settings)

if TYPE_CHECKING:
    from meshserve.cli.launcher import MeshConfig


def mesh_config(port: int, executors: int, model: str, dtype: str, kv_cache_memory: str, extra: list[str],
                tenants: Optional[str], log_dir: Optional[str], kvstore_memory: Optional[str] = None,
                metrics: bool = False, result_cache_size: int = 0, task_store: str = "memory") -> MeshConfig:
    """The ``MeshConfig`` of ``up``'s flags.

    ``dtype``, ``kv_cache_memory`` (bytes, e.g. ``1GiB``) and ``extra`` become the
    executors' flags; ``result_cache_size`` (entries) and ``task_store`` (``memory`` or a
    ``redis://`` URL) go to the gateway; ``kvstore_memory`` None starts no kvstore.
    """
    from meshserve.cli.launcher import MeshConfig

    args = ["--dtype", dtype, "--kv-cache-memory", kv_cache_memory, *extra]
    return MeshConfig(port=port, executors=executors, model=model, executor_args=args, tenants_file=tenants,
                      log_dir=Path(log_dir) if log_dir else None, kvstore_memory=kvstore_memory, metrics=metrics,
                      result_cache_size=result_cache_size, task_store=task_store)


def up(
    port: int = typer.Option(50051, min=0, max=65535, help="Public port of the gateway."),
    executors: int = typer.Option(1, min=1, help="Number of executor processes."),
    model: str = typer.Option("default", help="Model alias, .gguf file or safetensors folder."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    kv_cache_memory: str = typer.Option("1GiB", "--kv-cache-memory", help="KV cache budget of each executor."),
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file."),
    log_dir: Optional[str] = typer.Option(None, help="Write each service's log here instead of the terminal."),
    kvstore: bool = typer.Option(False, "--kvstore", help="Start one kvstore and connect every executor to it."),
    kvstore_memory: str = typer.Option("1GiB", "--kvstore-memory", help="Memory tier budget of that kvstore."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="Give every service a free port for its "
                                 "Prometheus /metrics endpoint and print them."),
    result_cache_size: int = ResultCacheSizeOpt,
    task_store: str = TaskStoreOpt,
    autoscale: Optional[str] = typer.Option(None, "--autoscale", help="MIN..MAX: start and drain executor processes "
                                            "as the scheduler's planner says (--executors is then MIN)."),
    planner_interval_s: float = typer.Option(60.0, "--planner-interval-s", help="With --autoscale: the planner's "
                                             "interval (seconds; see `meshserve scheduler`)."),
    planner_season_s: float = typer.Option(86400.0, "--planner-season-s", help="With --autoscale: the load's "
                                           "season (seconds)."),
    executor_capacity: float = typer.Option(2000.0, "--executor-capacity-tokens-per-s", help="With --autoscale: "
                                            "one executor's capacity until measured (tokens/s)."),
    scale_down_cooldown_s: float = typer.Option(300.0, "--scale-down-cooldown-s", help="With --autoscale: seconds "
                                                "of lower load before one executor less."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
) -> None:
    """Start the whole mesh on loopback; Ctrl-C stops it cleanly."""
    from gateway.task_store_registry import task_store_kind
    from meshserve.cli.launcher import Mesh

    from meshserve.cli import processes

    try:  # checked before any service starts: a usage error, exit code 2
        task_store_kind(task_store)
        processes.engine_config(model, dtype, kv_cache_memory, block_size=16, max_num_seqs=64,
                                max_num_batched_tokens=2048, no_chunked_prefill=False, max_model_len=None,
                                num_threads=None)  # the executors' flags, as each executor checks them
        parse_bytes(kvstore_memory)
        scale = None
        if autoscale is not None:
            from meshserve.cli.autoscale import parse_range
            from scheduler.planner import PlannerConfig

            scale = parse_range(autoscale)
            executors, metrics = max(1, scale[0]), True  # the planner's metric is read from /metrics
            planner_args = ["--planner-interval-s", str(planner_interval_s), "--planner-season-s",
                            str(planner_season_s), "--min-executors", str(scale[0]), "--max-executors",
                            str(scale[1]), "--executor-capacity-tokens-per-s", str(executor_capacity),
                            "--scale-down-cooldown-s", str(scale_down_cooldown_s)]
            PlannerConfig(interval_s=planner_interval_s, season_s=planner_season_s, min_executors=scale[0],
                          max_executors=scale[1], capacity_tokens_per_s=executor_capacity,
                          scale_down_cooldown_s=scale_down_cooldown_s)  # checked here: a usage error
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    config = mesh_config(port, executors, model, dtype, kv_cache_memory, [], tenants, log_dir,
                         kvstore_memory if kvstore else None, metrics, result_cache_size=result_cache_size,
                         task_store=task_store)
    if scale is not None:
        config.scheduler_args += planner_args
    mesh = Mesh(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    failed = False
    try:  # start() stops whatever it started when it fails
        asyncio.run(mesh.start())
    except KeyboardInterrupt:
        typer.echo("meshserve stopped.")
        return
    except (OSError, RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        kv = f", kvstore {mesh.kvstore_address}" if mesh.kvstore_address else ""
        typer.echo(f"meshserve is up: gateway {mesh.gateway_address}, scheduler {mesh.scheduler_address}, "
                   f"executors {', '.join(mesh.executor_addresses)}{kv}. Ctrl-C stops it.")
        for name, address in mesh.metrics_addresses.items():
            typer.echo(f"  metrics {name}: http://{address}/metrics")
        if scale is not None:
            from meshserve.cli.autoscale import LocalAutoscaler

            typer.echo(f"autoscaling executors within {scale[0]}..{scale[1]}")
            gone = asyncio.run(LocalAutoscaler(mesh, *scale).run(stop))
        else:
            while not stop.wait(0.5) and not mesh.exited():
                pass
            gone = mesh.exited()
        if gone:
            typer.echo(f"service(s) exited: {', '.join(gone)}; stopping the mesh", err=True)
            failed = True
    except KeyboardInterrupt:
        pass
    finally:
        mesh.stop()
        typer.echo("meshserve stopped.")
    if failed:
        raise typer.Exit(1)


def demo(
    port: int = typer.Option(0, min=0, max=65535, help="Gateway port (0: a free one)."),
    executors: int = typer.Option(1, min=1, help="Number of executor processes."),
    max_tokens: int = typer.Option(96, help="Tokens per answer."),
) -> None:
    """Start the mesh, stream 8 concurrent chat answers, print a summary, stop."""
    from meshserve.cli.demo import run_demo

    sys.exit(run_demo(port, executors, max_tokens))
