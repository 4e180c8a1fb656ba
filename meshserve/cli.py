"""The ``meshserve`` command line (typer).

``up`` starts the local mesh, ``demo`` runs it on 8 real chat prompts,
``scheduler|executor|gateway`` start one service (for containers), ``generate`` is
a client, ``bench`` measures throughput and latency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from meshserve.task_cli import task_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="meshserve: LLM serving as a mesh of gRPC services.")

TracesOpt = typer.Option(None, "--traces", help="Trace exporter: none, console, otlp (default: $MESHSERVE_TRACES or none).")
OtlpOpt = typer.Option(None, "--otlp-endpoint", help="OTLP/gRPC collector host:port (default localhost:4317).")
SampleOpt = typer.Option(None, "--trace-sample-ratio", min=0.0, max=1.0,
                         help="Fraction of new traces kept, ParentBased(TraceIdRatioBased) "
                              "(default: $MESHSERVE_TRACE_SAMPLE_RATIO or 1).")
MetricsPortOpt = typer.Option(None, "--metrics-port", min=0, max=65535,
                              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged; "
                                   "default: off).")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _serve(coro) -> None:
    """Runs a service's coroutine; a start-up failure the operator can fix (bad
    model path or flag value, busy port, unreachable scheduler) is one line on
    stderr and exit code 1, not a traceback. Anything else is our bug and keeps
    its traceback."""
    try:
        asyncio.run(coro)
    except (ValueError, OSError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _traces(exporter: Optional[str], endpoint: Optional[str], sample_ratio: Optional[float] = None) -> None:
    import os

    if exporter:
        os.environ["MESHSERVE_TRACES"] = exporter
    if endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    if sample_ratio is not None:  # in the environment: `up` hands it to every service process
        os.environ["MESHSERVE_TRACE_SAMPLE_RATIO"] = repr(sample_ratio)


def _engine_config(model, dtype, kv_cache_memory, block_size, max_num_seqs, max_num_batched_tokens,
                   no_chunked_prefill, max_model_len, num_threads, no_prefix_caching=False, max_batch_wait_ms=0.0,
                   attention_backend="auto", device="cpu", enable_kv_events=False):
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from meshserve.services import parse_bytes

    try:
        return EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            num_threads=num_threads,
            attention_backend=attention_backend,
            device=device,
            cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=parse_bytes(kv_cache_memory),
                              enable_prefix_caching=not no_prefix_caching,
                              enable_kv_events=enable_kv_events and not no_prefix_caching),
            batch=BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       enable_chunked_prefill=not no_chunked_prefill,
                                       max_batch_wait_ms=max_batch_wait_ms),
        )
    except ValueError as exc:  # a bad flag value: typer prints usage and the message, exit code 2
        raise typer.BadParameter(str(exc)) from None


@app.command()
def scheduler(
    port: int = typer.Option(50052, min=0, max=65535, help="Port of the Scheduler service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    queue_policy: str = typer.Option("fcfs", "--queue-policy", help="fcfs, priority or sjf (shortest-job-first "
                                     "on predicted cost, with aging)."),
    max_queue_wait_s: float = typer.Option(30.0, "--max-queue-wait-s", help="sjf aging bound (seconds)."),
    max_queue_len: int = typer.Option(4096, "--max-queue-len", help="Most queued requests."),
    max_queue_tokens: Optional[int] = typer.Option(None, "--max-queue-tokens", help="Most queued prompt tokens "
                                                   "(default: no bound)."),
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file (KV quotas; default: none)."),
    pools: Optional[str] = typer.Option(None, "--pools", help="Pools TOML file: priority classes → executor pools "
                                        "and spill rules (default: any pool)."),
    kvstore: Optional[str] = typer.Option(None, "--kvstore", help="host:port of the kvstore the executors share: "
                                          "follow its placements and credit its blocks when routing."),
    kvstore_token_cost: float = typer.Option(0.1, "--kvstore-token-cost", min=0.0, max=1.0,
                                             help="Routing cost of a prompt token fetched from the kvstore, "
                                             "relative to one computed."),
    kv_reservation: str = typer.Option("prompt", "--kv-reservation", help="prompt (room = prompt blocks) or "
                                       "predicted (also the predicted output and the growth of running leases)."),
    routing: str = typer.Option("prefix", "--routing", help="prefix (prefix-cache hits and load) or least-loaded."),
    routing_load_weight: float = typer.Option(1.0, "--routing-load-weight", min=0.0,
                                              help="Cost of a token of executor load vs. an uncached prompt token."),
    routing_balance_factor: float = typer.Option(1.5, "--routing-balance-factor", min=1.0,
                                                 help="Prefix bonus dropped above this x the mean load..."),
    routing_balance_abs_tokens: float = typer.Option(2048.0, "--routing-balance-abs-tokens", min=0.0,
                                                     help="...and this many tokens above it."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    metrics_port: Optional[int] = MetricsPortOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the global scheduler (executor registry, admission queue, pools and routing)."""
    from meshserve.services import run_scheduler, scheduler_config
    from scheduler.routing import RoutingConfig

    _logging(log_level)
    _traces(traces, otlp_endpoint, trace_sample_ratio)
    try:
        if kvstore is not None and not _is_address(kvstore):
            raise ValueError(f"--kvstore must be HOST:PORT, got {kvstore!r}")
        route_cfg = RoutingConfig(routing, load_weight=routing_load_weight, balance_factor=routing_balance_factor,
                                  balance_abs_tokens=routing_balance_abs_tokens, kvstore_token_cost=kvstore_token_cost)
        config = scheduler_config(queue_policy, max_queue_wait_s, max_queue_len, max_queue_tokens, tenants, pools,
                                  route_cfg, kv_reservation)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    _serve(run_scheduler(port, host, config, kvstore, metrics_port))


@app.command()
def executor(
    scheduler: str = typer.Option(..., "--scheduler", help="host:port of the scheduler."),
    port: int = typer.Option(50053, min=0, max=65535, help="Port of the Executor service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (and advertise)."),
    model: str = typer.Option("default", help="Model alias, .gguf file or safetensors folder."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    kv_cache_memory: str = typer.Option("1GiB", "--kv-cache-memory", help="KV cache budget in bytes (512MiB, 2GB…)."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    max_num_seqs: int = typer.Option(64, help="Most requests in the running batch."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step."),
    no_chunked_prefill: bool = typer.Option(False, "--no-chunked-prefill", help="Prefill each prompt in one step."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Never reuse cached prefix KV blocks."),
    max_batch_wait_ms: float = typer.Option(0.0, "--max-batch-wait-ms", min=0.0,
                                            help="Hold a new prefill up to this long to batch it with others."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest prompt + output (default: the model's)."),
    num_threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
    attention_backend: str = typer.Option("auto", help="auto (triton on CUDA, else torch), torch or triton."),
    device: str = typer.Option("cpu", help="torch device of the model and KV cache: cpu, cuda, cuda:1…"),
    executor_id: Optional[str] = typer.Option(None, help="Id in the registry (default executor-PORT)."),
    pool: str = typer.Option("default", help="Instance pool it registers in (see the scheduler's --pools file)."),
    step_timeout_s: float = typer.Option(60.0, "--step-timeout-s", min=0.001,
                                         help="An engine step running longer is wedged: NOT_SERVING until it returns."),
    advertise: Optional[str] = typer.Option(None, "--advertise", help="host:port the gateway dials (default host:port; "
                                            "set it when listening on 0.0.0.0)."),
    kvstore: Optional[str] = typer.Option(None, "--kvstore", help="host:port of a kvstore: share prefix KV blocks."),
    kvstore_fetch_timeout: float = typer.Option(5.0, "--kvstore-fetch-timeout", min=0.001,
                                                help="Seconds to wait for a kvstore fetch before recomputing."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    metrics_port: Optional[int] = MetricsPortOpt,
    peak_flops: Optional[float] = typer.Option(None, "--peak-flops", min=1.0,
                                               help="Peak FLOP/s of the device for the MFU metric (default: by GPU "
                                                    "name, e.g. H100 989e12; CPU 1e12)."),
    log_level: str = typer.Option("info"),
) -> None:
    """Run one executor: a model replica with its continuous-batching engine."""
    from meshserve.services import run_executor

    _logging(log_level)
    _traces(traces, otlp_endpoint, trace_sample_ratio)
    cfg = _engine_config(model, dtype, kv_cache_memory, block_size, max_num_seqs, max_num_batched_tokens,
                         no_chunked_prefill, max_model_len, num_threads, no_prefix_caching, max_batch_wait_ms,
                         attention_backend, device, enable_kv_events=True)  # forwarded for prefix-aware routing
    if kvstore is not None and not _is_address(kvstore):
        raise typer.BadParameter(f"--kvstore must be HOST:PORT, got {kvstore!r}")
    from meshserve.launcher import port_is_free

    for flag, p in (("--port", port), ("--metrics-port", metrics_port)):
        if p and not port_is_free(p, host):  # checked before the model loads
            typer.echo(f"error: executor: cannot listen on {host}:{p} (port in use or not allowed); "
                       f"choose one with {flag}", err=True)
            raise typer.Exit(1)
    _serve(run_executor(cfg, port, host, scheduler, executor_id, pool, advertise, step_timeout_s=step_timeout_s,
                        kvstore_address=kvstore, kvstore_fetch_timeout_s=kvstore_fetch_timeout,
                        metrics_port=metrics_port, peak_flops=peak_flops))


def _is_address(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@app.command("kvstore")
def kvstore_cmd(
    port: int = typer.Option(50054, min=0, max=65535, help="Port of the KVStore service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    memory: str = typer.Option("1GiB", "--memory", help="Byte budget of the memory tier (512MiB, 2GB…)."),
    disk_dir: Optional[str] = typer.Option(None, "--disk-dir", help="Directory of the disk tier (emptied at start)."),
    disk: str = typer.Option("10GiB", "--disk", help="Byte budget of the disk tier (with --disk-dir)."),
    max_events: int = typer.Option(65536, "--max-events", min=1, help="Placement events kept for followers."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    metrics_port: Optional[int] = MetricsPortOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the kvstore: prefix KV blocks shared by executors."""
    from meshserve.services import parse_bytes, run_kvstore

    _logging(log_level)
    _traces(traces, otlp_endpoint, trace_sample_ratio)
    try:
        memory_bytes, disk_bytes = parse_bytes(memory), parse_bytes(disk)
        if memory_bytes < 1 or (disk_dir and disk_bytes < 1):
            raise ValueError("--memory and --disk must be at least 1 byte")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    _serve(run_kvstore(port, host, memory_bytes, disk_dir, disk_bytes, max_events, metrics_port))


@app.command()
def gateway(
    scheduler: str = typer.Option(..., "--scheduler", help="host:port of the scheduler."),
    port: int = typer.Option(50051, min=0, max=65535, help="Public port of the Gateway service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    model: str = typer.Option("default", help="Model alias or path (for the tokenizer and limits)."),
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file (default: open, tenant 'default')."),
    block_size: int = typer.Option(16, "--block-size", min=0, help="Tokens per block of the prompt hashes sent "
                                   "for prefix-aware routing: the executors' --block-size (0: send none)."),
    result_cache_size: int = typer.Option(0, "--result-cache-size", min=0, help="Entries of the result cache of "
                                          "deterministic requests (greedy or seeded), LRU; 0: off."),
    result_cache_ttl_s: float = typer.Option(600.0, "--result-cache-ttl-s", min=0.001,
                                             help="Seconds a result-cache entry lives."),
    task_store: str = typer.Option("memory", "--task-store", help="Async task store: memory, or "
                                   "redis://host:port/db (shared by gateways)."),
    task_ttl_s: float = typer.Option(3600.0, "--task-ttl-s", min=0.001, help="Seconds a finished task is kept."),
    max_tasks: int = typer.Option(10_000, "--max-tasks", min=1, help="Most tasks the memory store keeps "
                                  "(finished ones are dropped oldest first; then SubmitTask is refused)."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    metrics_port: Optional[int] = MetricsPortOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the public gateway."""
    from gateway.task_store import task_store_kind
    from meshserve.services import run_gateway

    try:
        task_store_kind(task_store)
    except ValueError as exc:  # a usage error, exit code 2
        raise typer.BadParameter(str(exc)) from None
    _logging(log_level)
    _traces(traces, otlp_endpoint, trace_sample_ratio)
    _serve(run_gateway(model, port, host, scheduler, tenants, block_size, result_cache_size, result_cache_ttl_s,
                       task_store, task_ttl_s, max_tasks, metrics_port))


def _mesh_config(port, executors, model, dtype, kv_cache_memory, extra, tenants, log_dir, kvstore_memory=None,
                 metrics=False):
    from meshserve.launcher import MeshConfig

    args = ["--dtype", dtype, "--kv-cache-memory", kv_cache_memory, *extra]
    return MeshConfig(port=port, executors=executors, model=model, executor_args=args, tenants_file=tenants,
                      log_dir=Path(log_dir) if log_dir else None, kvstore_memory=kvstore_memory, metrics=metrics)


@app.command()
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
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
) -> None:
    """Start the whole mesh on loopback; Ctrl-C stops it cleanly."""
    import signal
    import threading

    from meshserve.launcher import Mesh

    _traces(traces, otlp_endpoint, trace_sample_ratio)
    mesh = Mesh(_mesh_config(port, executors, model, dtype, kv_cache_memory, [], tenants, log_dir,
                             kvstore_memory if kvstore else None, metrics))
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


@app.command()
def demo(
    port: int = typer.Option(0, min=0, max=65535, help="Gateway port (0: a free one)."),
    executors: int = typer.Option(1, min=1, help="Number of executor processes."),
    max_tokens: int = typer.Option(96, help="Tokens per answer."),
) -> None:
    """Start the mesh, stream 8 concurrent chat answers, print a summary, stop."""
    from meshserve.demo import run_demo

    sys.exit(run_demo(port, executors, max_tokens))


@app.command()
def generate(
    addr: str = typer.Option("127.0.0.1:50051", "--addr", help="Gateway host:port."),
    prompt: list[str] = typer.Option(..., "--prompt", help="Prompt text; repeat to send several concurrently."),
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as one user chat message."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens"),
    temperature: Optional[float] = typer.Option(None, "--temperature"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; may repeat."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Min-p in [0, 1] (0: off)."),
    min_tokens: Optional[int] = typer.Option(None, "--min-tokens", help="No EOS / stop token before this many."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="> 0 (1: off)."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="In [-2, 2] (0: off)."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="In [-2, 2] (0: off)."),
    n: Optional[int] = typer.Option(None, "--n", help="Choices per prompt, in [1, 16]."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Top-k logprobs per token, in [0, 20] (--json)."),
    prompt_logprobs: Optional[int] = typer.Option(None, "--prompt-logprobs",
                                                  help="Top-k logprobs per prompt token, in [0, 20] (--json)."),
    priority: Optional[int] = typer.Option(None, "--priority"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MESHSERVE_API_KEY"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt and choice, one per line."),
    async_task: bool = typer.Option(False, "--async", help="Submit each prompt as an async task (SubmitTask), "
                                    "poll GetTask until it is done, then print the result."),
) -> None:
    """Send prompts to a gateway and print the answers (streamed for one prompt and one choice)."""
    import grpc

    from meshserve.client import TaskFailed, build_request, channel, generate_choices, run_task
    from meshserve.v1 import gateway_pb2_grpc

    async def main() -> int:
        metadata = (("x-api-key", api_key),) if api_key else ()
        async with channel(addr) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                reqs = [build_request(None if chat else p, chat=[("user", p)] if chat else None,
                                      max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                      seed=seed, stop=stop, ignore_eos=ignore_eos, priority=priority, min_p=min_p,
                                      min_tokens=min_tokens, repetition_penalty=repetition_penalty,
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, n=n,
                                      logprobs=logprobs, prompt_logprobs=prompt_logprobs) for p in prompt]
            except ValueError as exc:  # an integer the wire type cannot hold
                print(f"error: bad option value: {exc}", file=sys.stderr)
                return 2
            live = len(reqs) == 1 and not as_json and (n or 1) == 1 and not async_task
            on_delta = (lambda text, _ids, _i: (sys.stdout.write(text), sys.stdout.flush())) if live else None
            calls = (run_task(stub, r, metadata) if async_task else generate_choices(stub, r, metadata,
                                                                                        on_delta=on_delta)
                     for r in reqs)
            results = await asyncio.gather(*calls, return_exceptions=True)
        code = 0
        for p, choices in zip(prompt, results):
            if isinstance(choices, (grpc.aio.AioRpcError, TaskFailed)):
                code = 1
                name, details = ((choices.code().name, choices.details()) if isinstance(choices, grpc.aio.AioRpcError)
                                 else (choices.code, choices.message))
                err = {"error": {"code": name, "message": details}}
                print(json.dumps(err) if as_json else f"error: {name}: {details}",
                      file=sys.stdout if as_json else sys.stderr)
                continue
            if isinstance(choices, BaseException):
                raise choices
            for r in choices:
                if as_json:
                    print(json.dumps(r.as_json()))
                elif live:
                    print(f"\n[{r.finish_reason}; {r.usage['completion_tokens']} tokens; "
                          f"TTFT {r.timings['ttft_s']:.3f} s]")
                else:
                    title = f"{p} [choice {r.index}]" if len(choices) > 1 else p
                    print(f"### {title}\n{r.text}\n[{r.finish_reason}; {r.usage['completion_tokens']} tokens]\n")
        return code

    sys.exit(asyncio.run(main()))


@app.command()
def bench(
    target: str = typer.Option("engine", "--target", help="engine, mesh, hf-generate, hf-continuous or hf-static."),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests in flight (closed loop); hf-generate runs 1; "
                                    "hf-static: the batch size."),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Open loop: Poisson arrivals at this "
                                                 "many requests/s (inf: all at once) instead of --concurrency."),
    sweep_concurrency: Optional[str] = typer.Option(None, "--sweep-concurrency", help="Closed-loop sweep, e.g. "
                                                    "1,4,16: one point per concurrency."),
    sweep_rate: Optional[str] = typer.Option(None, "--sweep-rate", help="Open-loop sweep, e.g. 0.5,1,2 (requests/s)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="hf-generate, hf-static or hf-continuous: run "
                                           "it on the same requests after the target at every point; print ratios."),
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
    addr: Optional[str] = typer.Option(None, "--addr", help="mesh target: a running gateway's host:port."),
    executor_addr: list[str] = typer.Option([], "--executor-addr", help="mesh target with --addr: an executor "
                                            "whose Stats to sample; may repeat."),
    executors: int = typer.Option(1, min=1, help="mesh target: executor processes to launch."),
    prompt_len_median: int = typer.Option(150, help="Median prompt length (tokens; multi-turn: of each user "
                                          "message)."),
    output_len_median: int = typer.Option(128, help="Median output length (tokens)."),
    warmup: int = typer.Option(2, help="Unmeasured warm-up requests."),
    num_threads: Optional[int] = typer.Option(None, help="torch threads of every target (default: cores - 1, "
                                              "one core left for the other services and the client)."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Measure output tokens/s, TTFT, TPOT, e2e latency and KV/prefix-cache use of a target on a seeded workload."""
    from meshserve.bench import BenchConfig, WorkloadSpec, main as run
    from meshserve.bench.jsonl_workload import WorkloadFileError, count_requests
    from meshserve.bench.sweep import BASELINES, parse_values, sweep_points

    _logging(log_level)
    try:
        if baseline is not None and baseline not in BASELINES:
            raise ValueError(f"--baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
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
                          executor_addrs=tuple(executor_addr), request_rate=request_rate)
        points = sweep_points(concurrency, request_rate, parse_values(sweep_concurrency, int),
                              parse_values(sweep_rate, float))
        if baseline == "hf-static" and any(p.request_rate is not None for p in points):
            raise ValueError("hf-static runs static batches and has no open loop; use another baseline")
    except (ValueError, WorkloadFileError) as exc:
        raise typer.BadParameter(str(exc)) from None
    args = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    command = " ".join(["meshserve bench", *(shlex.quote(a) for a in args)])
    try:
        code = run(cfg, report_json, points, baseline, report_dir, quiet, command)
    except WorkloadFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        code = 2
    sys.exit(code)


SIM_WORKLOADS = ("heavy-tail", "prefix-routing", "quota-isolation")


@app.command()
def sim(
    policy: str = typer.Option("sjf", "--policy", help="Queue policy: sjf, fcfs or priority (heavy-tail)."),
    workload: str = typer.Option("heavy-tail", "--workload", help="heavy-tail (queue policies), prefix-routing "
                                 "(shared system prompts over prefix caches) or quota-isolation (a tenant at 10x "
                                 "its KV quota beside another)."),
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
    report_json: Optional[str] = typer.Option(None, "--report-json", help="Write the JSON report here."),
) -> None:
    """Discrete-event simulations on the scheduler's own core (no model, no gRPC)."""
    from dataclasses import replace

    from scheduler.queue_policy import QueuePolicy
    from scheduler.routing import RoutingConfig

    if workload not in SIM_WORKLOADS:
        raise typer.BadParameter(f"unknown workload {workload!r} ({', '.join(SIM_WORKLOADS)})")
    try:
        QueuePolicy(policy, max_queue_wait_s)
        RoutingConfig(routing)
        if kv_reservation not in ("prompt", "predicted"):
            raise ValueError(f"unknown kv reservation {kv_reservation!r} (choose from prompt, predicted)")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if workload == "heavy-tail":
        from scheduler.sim import SimConfig, run

        report = run(SimConfig(policy=policy, seed=seed, num_requests=num_requests or 2000, load=load,
                               max_queue_wait_s=max_queue_wait_s, num_executors=executors or 2,
                               kv_reservation=kv_reservation))
        keys = ("short_half_mean_latency_s", "short_half_p99_latency_s", "long_half_mean_latency_s",
                "long_half_p99_latency_s", "max_wait_s", "aging_bound_s", "output_len_log_sigma")
    elif workload == "prefix-routing":
        from scheduler.routing_sim import RoutingSimConfig, compare

        cfg = RoutingSimConfig(seed=seed, num_requests=num_requests or 2000)
        cfg = replace(cfg, rate=rate or cfg.rate,
                      mesh=replace(cfg.mesh, routing=routing, num_executors=executors or cfg.mesh.num_executors))
        report = compare(cfg)
        keys = ("hit_rate", "ideal_hit_rate", "hit_rate_vs_ideal", "busiest_over_mean", "ttft_p50_s", "ttft_p99_s")
    else:
        from scheduler.isolation_sim import IsolationSimConfig, run as run_isolation

        cfg = IsolationSimConfig(seed=seed, num_b_requests=num_requests or 400)
        cfg = replace(cfg, b_rate=rate or cfg.b_rate,
                      mesh=replace(cfg.mesh, num_executors=executors or cfg.mesh.num_executors))
        report = run_isolation(cfg)
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


app.command("task")(task_command)  # meshserve/task_cli.py


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
