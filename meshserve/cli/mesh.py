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

from meshserve.cli.options import (InsecureOpt, OtlpOpt, ResultCacheSizeOpt, SampleOpt, TaskStoreOpt, TLSCAOpt,
                                   TLSCertOpt, TLSKeyOpt, TracesOpt, parse_bytes, export_trace_settings, tls_settings)

if TYPE_CHECKING:
    from meshserve.cli.launcher import MeshConfig


def mesh_config(port: int, executors: int, model: str, dtype: str, kv_cache_memory: str, extra: list[str],
                tenants: Optional[str], log_dir: Optional[str], kvstore_memory: Optional[str] = None,
                metrics: bool = False, result_cache_size: int = 0, task_store: str = "memory",
                tls_dir: Optional[str] = None, tls_files: Optional[tuple[str, str, str]] = None) -> MeshConfig:
    """The ``MeshConfig`` of ``up``'s flags.

    ``dtype``, ``kv_cache_memory`` (bytes, e.g. ``1GiB``) and ``extra`` become the
    executors' flags; ``result_cache_size`` (entries) and ``task_store`` (``memory`` or a
    ``redis://`` URL) go to the gateway; ``kvstore_memory`` None starts no kvstore.
    ``tls_dir`` (role certificates) or ``tls_files`` (cert, key, CA): mutual TLS;
    neither: plaintext on loopback.
    """
    from meshserve.cli.launcher import MeshConfig

    args = ["--dtype", dtype, "--kv-cache-memory", kv_cache_memory, *extra]
    return MeshConfig(port=port, executors=executors, model=model, executor_args=args, tenants_file=tenants,
                      log_dir=Path(log_dir) if log_dir else None, kvstore_memory=kvstore_memory, metrics=metrics,
                      result_cache_size=result_cache_size, task_store=task_store,
                      tls_dir=Path(tls_dir) if tls_dir else None, tls_files=tls_files)


def parallel_args(tensor_parallel_size: int, pipeline_parallel_size: int) -> list[str]:
    """The executors' parallel flags (none at 1 × 1)."""
    args = []
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size != 1:
        args += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    return args


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
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                             help="Ranks (processes; GPUs on CUDA) each executor's layers are "
                                                  "sharded over."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", min=1,
                                               help="Pipeline stages each executor's layers are split into."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="Give every service a free port for its "
                                 "Prometheus /metrics endpoint and print them."),
    result_cache_size: int = ResultCacheSizeOpt,
    task_store: str = TaskStoreOpt,
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    tls_dir: Optional[str] = typer.Option(None, "--tls-dir", help="Run the mesh over mutual TLS with the role "
                                          "certificates in this directory (made there by `meshserve certs` "
                                          "when it holds none). Default: plaintext on loopback."),
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
) -> None:
    """Start the whole mesh on loopback; Ctrl-C stops it cleanly (plaintext unless --tls-dir or --tls-*)."""
    from gateway.task_store_registry import task_store_kind
    from meshserve.cli.launcher import Mesh

    from meshserve.cli import processes

    try:  # checked before any service starts: a usage error, exit code 2
        task_store_kind(task_store)
        cfg = processes.engine_config(model, dtype, kv_cache_memory, block_size=16, max_num_seqs=64,
                                      max_num_batched_tokens=2048, no_chunked_prefill=False, max_model_len=None,
                                      num_threads=None, tensor_parallel_size=tensor_parallel_size,
                                      pipeline_parallel_size=pipeline_parallel_size)  # as each executor checks them
        processes.check_parallel_layout(cfg)
        parse_bytes(kvstore_memory)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    tls_files = None
    if tls_cert or tls_key or tls_ca or insecure:
        if tls_dir:
            raise typer.BadParameter("--tls-dir cannot be combined with --tls-cert/--tls-key/--tls-ca/--insecure")
        tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)
        tls_files = (tls.cert, tls.key, tls.ca) if tls.enabled else None
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    parallel = parallel_args(tensor_parallel_size, pipeline_parallel_size)
    mesh = Mesh(mesh_config(port, executors, model, dtype, kv_cache_memory, parallel, tenants, log_dir,
                            kvstore_memory if kvstore else None, metrics, result_cache_size=result_cache_size,
                            task_store=task_store, tls_dir=tls_dir, tls_files=tls_files))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    failed = False
    try:  # start() stops whatever it started when it fails
        asyncio.run(mesh.start())
    except KeyboardInterrupt:
        typer.echo("meshserve stopped.")
        return
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        kv = f", kvstore {mesh.kvstore_address}" if mesh.kvstore_address else ""
        if tls_dir:
            kv += f"; mutual TLS (certificates in {tls_dir}; clients: --tls-ca {tls_dir}/ca.pem)"
        typer.echo(f"meshserve is up: gateway {mesh.gateway_address}, scheduler {mesh.scheduler_address}, "
                   f"executors {', '.join(mesh.executor_addresses)}{kv}. Ctrl-C stops it.")
        for name, address in mesh.metrics_addresses.items():
            typer.echo(f"  metrics {name}: http://{address}/metrics")
        while not stop.wait(0.5):
            if mesh.exited():
                typer.echo(f"service(s) exited: {', '.join(mesh.exited())}; stopping the mesh", err=True)
                failed = True
                break
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
