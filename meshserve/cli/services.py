"""``meshserve scheduler|executor|kvstore|gateway``: one service per process (for containers).

Each command speaks mutual TLS (``--tls-cert``, ``--tls-key``, ``--tls-ca``) unless
``--insecure`` asks for plaintext; with neither it refuses to start (usage error).
Each command checks its flags (a bad value is a usage error, exit code 2), sets
up logging and tracing, and serves until SIGTERM; a start-up failure the
operator can fix is one line and exit code 1 (``options.serve``). What a command
runs is in ``meshserve.cli.processes``, imported when the command runs (it imports
gRPC and the service), so that ``meshserve --help`` stays fast.
"""

from __future__ import annotations

from typing import Optional

import typer

from meshserve.cli.options import (ChatTemplateOpt, ExecutorCapacityOpt, HealthPortOpt, HttpPortOpt, InsecureOpt,
                                   MetricsPortOpt, OtlpOpt, PlannerIntervalOpt, PlannerSeasonOpt, ResultCacheSizeOpt,
                                   RevisionOpt, SampleOpt, ScaleDownCooldownOpt, ServedModelNameOpt, StartBudgetOpt,
                                   TaskStoreOpt, TLSCAOpt, TLSCertOpt, TLSKeyOpt, TokenizerOpt, TracesOpt,
                                   export_trace_settings, is_address, parse_bytes, serve, setup_logging, tls_settings)

PrefixCacheScopeOpt = typer.Option(
    "tenant", "--prefix-cache-scope",
    help="tenant: prefix KV blocks are shared only within a tenant (no cross-tenant timing side channel); "
         "global: shared by all tenants. Gateway and executors must agree.")


def scheduler(
    port: int = typer.Option(50052, min=0, max=65535, help="Port of the Scheduler service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    queue_policy: str = typer.Option("fcfs", "--queue-policy", help="fcfs, priority or sjf (shortest-job-first "
                                     "on predicted cost, with aging)."),
    max_queue_wait_s: float = typer.Option(30.0, "--max-queue-wait-s", help="sjf aging bound (seconds)."),
    max_queue_len: int = typer.Option(4096, "--max-queue-len", help="Most queued requests."),
    max_queue_tokens: Optional[int] = typer.Option(None, "--max-queue-tokens", help="Most queued prompt tokens "
                                                   "(default: no bound)."),
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file (the tenants admitted, KV quotas, "
                                          "priority ceilings, rate limits; default: tenant 'default' only)."),
    lease_ttl_s: float = typer.Option(10.0, "--lease-ttl-s", min=0.001,
                                      help="Seconds a lease lives unless its gateway renews it."),
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
    health_port: Optional[int] = HealthPortOpt,
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
    planner_interval_s: float = PlannerIntervalOpt,
    planner_season_s: float = PlannerSeasonOpt,
    min_executors: int = typer.Option(1, "--min-executors", min=0, help="Planner: fewest executors desired."),
    max_executors: int = typer.Option(8, "--max-executors", min=1, help="Planner: most executors desired."),
    executor_capacity: float = ExecutorCapacityOpt,
    cold_start_s: float = typer.Option(60.0, "--cold-start-s", help="Planner: an executor's cold start until "
                                       "measured (seconds)."),
    target_utilization: float = typer.Option(0.8, "--target-utilization", help="Planner: fraction of capacity "
                                             "planned for."),
    scale_down_cooldown_s: float = ScaleDownCooldownOpt,
    no_forecast: bool = typer.Option(False, "--no-forecast", help="Planner: reactive only (no Holt-Winters)."),
    start_budget_s: Optional[float] = StartBudgetOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the global scheduler (executor registry, admission queue, pools and routing)."""
    from meshserve.cli import processes
    from scheduler.routing import RoutingConfig

    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)
    setup_logging(log_level)
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    try:
        if kvstore is not None and not is_address(kvstore):
            raise ValueError(f"--kvstore must be HOST:PORT, got {kvstore!r}")
        route_cfg = RoutingConfig(routing, load_weight=routing_load_weight, balance_factor=routing_balance_factor,
                                  balance_abs_tokens=routing_balance_abs_tokens, kvstore_token_cost=kvstore_token_cost)
        config = processes.scheduler_config(queue_policy, max_queue_wait_s, max_queue_len, max_queue_tokens,
                                            tenants, pools, route_cfg, kv_reservation, lease_ttl_s,
                                            start_budget_s)
        from scheduler.planner import PlannerConfig

        planner = PlannerConfig(interval_s=planner_interval_s, season_s=planner_season_s,
                                min_executors=min_executors, max_executors=max_executors,
                                capacity_tokens_per_s=executor_capacity, cold_start_s=cold_start_s,
                                target_utilization=target_utilization, scale_down_cooldown_s=scale_down_cooldown_s,
                                predictive=not no_forecast)
    except (ValueError, OSError) as exc:  # OSError: a --tenants or --pools file that cannot be read
        raise typer.BadParameter(str(exc)) from None
    serve(processes.run_scheduler(port, host, config, kvstore, metrics_port, tls, planner, health_port))


def executor(
    scheduler: str = typer.Option(..., "--scheduler", help="host:port of the scheduler."),
    port: int = typer.Option(50053, min=0, max=65535, help="Port of the Executor service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (and advertise)."),
    model: str = typer.Option("default", help="Model alias, .gguf file, safetensors folder or Hugging Face id "
                              "(from the local Hugging Face cache)."),
    revision: Optional[str] = RevisionOpt,
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    kv_cache_memory: str = typer.Option("1GiB", "--kv-cache-memory", help="KV cache budget in bytes (512MiB, 2GB…)."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    max_num_seqs: int = typer.Option(64, help="Most requests in the running batch."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step."),
    no_chunked_prefill: bool = typer.Option(False, "--no-chunked-prefill", help="Prefill each prompt in one step."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Never reuse cached prefix KV blocks."),
    max_batch_wait_ms: float = typer.Option(0.0, "--max-batch-wait-ms", min=0.0,
                                            help="Hold a new prefill up to this long to batch it with others."),
    long_prefill_token_threshold: int = typer.Option(0, "--long-prefill-token-threshold", min=0,
                                                     help="Most prompt tokens one request computes in a step: long "
                                                          "prompts prefill in chunks this size (0: no cap)."),
    short_prefill_tokens: Optional[int] = typer.Option(None, "--short-prefill-tokens", min=0,
                                                       help="Short prefills first: prefills with at most this many "
                                                            "tokens to compute run first, longer ones sit out up to "
                                                            "4 steps (default 64; 0: off)."),
    prefill_order: Optional[str] = typer.Option(None, "--prefill-order",
                                                help="Order of waiting prompts within a priority: shortest (fewest "
                                                     "tokens first; a prompt passed over at most 4 steps) or "
                                                     "arrival (FCFS). Default shortest."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest prompt + output (default: the model's)."),
    num_threads: Optional[int] = typer.Option(None, show_default="torch's own, about one per core",
                                              help="torch CPU threads."),
    attention_backend: str = typer.Option("auto", help="auto (triton on CUDA, else torch), torch or triton."),
    device: str = typer.Option("cpu", help="torch device of the model and KV cache: cpu, cuda, cuda:1…"),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                               help="Replay decode steps from CUDA graphs captured at start-up "
                                                    "(default: on one CUDA device with the triton backend; "
                                                    "ignored elsewhere)."),
    compile: bool = typer.Option(False, "--compile/--no-compile",
                                 help="torch.compile the decode steps at start-up, per batch-size bucket "
                                      "(CPU, float32, one thread; minutes cold, cached on disk)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                             help="Ranks (processes; GPUs on CUDA) that shard every layer."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", min=1,
                                               help="Pipeline stages the layers are split into (processes)."),
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
    health_port: Optional[int] = HealthPortOpt,
    peak_flops: Optional[float] = typer.Option(None, "--peak-flops", min=1.0,
                                               help="Peak FLOP/s of the device for the MFU metric (default: by GPU "
                                                    "name, e.g. H100 989e12; CPU 1e12)."),
    max_buffered_outputs: int = typer.Option(256, "--max-buffered-outputs", min=1,
                                             help="Messages a request's reader may leave unread before the request "
                                                  "ends with RESOURCE_EXHAUSTED and its KV is freed."),
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
    prefix_cache_scope: str = PrefixCacheScopeOpt,
    drain_grace_s: float = typer.Option(30.0, "--drain-grace-s", min=0.0,
                                        help="On SIGTERM: seconds to finish the requests it runs (nothing new is "
                                             "routed to it) before it exits; those still running then end "
                                             "UNAVAILABLE, retryable."),
    log_level: str = typer.Option("info"),
) -> None:
    """Run one executor: a model replica with its continuous-batching engine."""
    from meshserve.cli import processes
    from meshserve.cli.ports import port_is_free

    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)  # before the model loads
    setup_logging(log_level)
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    try:
        # a size that does not split the model: refused from its config.json, before torch is imported
        processes.check_parallel_layout(model, revision, tensor_parallel_size, pipeline_parallel_size)
        cfg = processes.engine_config(model, dtype, kv_cache_memory, block_size, max_num_seqs,
                                      max_num_batched_tokens, no_chunked_prefill, max_model_len, num_threads,
                                      no_prefix_caching, max_batch_wait_ms, attention_backend, device,
                                      enable_kv_events=True,  # forwarded for prefix-aware routing
                                      tensor_parallel_size=tensor_parallel_size,
                                      pipeline_parallel_size=pipeline_parallel_size, revision=revision,
                                      cuda_graphs=cuda_graphs,
                                      compile=compile, long_prefill_token_threshold=long_prefill_token_threshold,
                                      short_prefill_tokens=short_prefill_tokens, prefill_order=prefill_order)
    except ValueError as exc:  # a bad flag value: typer prints usage and the message, exit code 2
        raise typer.BadParameter(str(exc)) from None
    if kvstore is not None and not is_address(kvstore):
        raise typer.BadParameter(f"--kvstore must be HOST:PORT, got {kvstore!r}")
    _check_scope(prefix_cache_scope)
    for flag, p in (("--port", port), ("--metrics-port", metrics_port), ("--health-port", health_port)):
        if p and not port_is_free(p, host):  # checked before the model loads
            typer.echo(f"error: executor: cannot listen on {host}:{p} (port in use or not allowed); "
                       f"choose one with {flag}", err=True)
            raise typer.Exit(1)
    serve(processes.run_executor(cfg, port, host, scheduler, executor_id, pool, advertise,
                                 step_timeout_s=step_timeout_s, kvstore_address=kvstore,
                                 kvstore_fetch_timeout_s=kvstore_fetch_timeout, metrics_port=metrics_port,
                                 peak_flops=peak_flops, max_buffered_outputs=max_buffered_outputs, tls=tls,
                                 prefix_cache_scope=prefix_cache_scope, drain_grace_s=drain_grace_s,
                                 health_port=health_port))


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
    health_port: Optional[int] = HealthPortOpt,
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the kvstore: prefix KV blocks shared by executors."""
    from meshserve.cli import processes

    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)
    setup_logging(log_level)
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    try:
        memory_bytes, disk_bytes = parse_bytes(memory), parse_bytes(disk)
        if memory_bytes < 1 or (disk_dir and disk_bytes < 1):
            raise ValueError("--memory and --disk must be at least 1 byte")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    serve(processes.run_kvstore(port, host, memory_bytes, disk_dir, disk_bytes, max_events, metrics_port, tls,
                                health_port))


def gateway(
    scheduler: str = typer.Option(..., "--scheduler", help="host:port of the scheduler."),
    port: int = typer.Option(50051, min=0, max=65535, help="Public port of the Gateway service."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    model: str = typer.Option("default", help="Model alias, path or Hugging Face id (for the tokenizer and limits)."),
    revision: Optional[str] = RevisionOpt,
    tokenizer: Optional[str] = TokenizerOpt,
    chat_template: Optional[str] = ChatTemplateOpt,
    served_model_name: Optional[list[str]] = ServedModelNameOpt,
    http_port: Optional[int] = HttpPortOpt,
    tenants: Optional[str] = typer.Option(None, help="Tenants TOML file (default: open, tenant 'default')."),
    block_size: int = typer.Option(16, "--block-size", min=0, help="Tokens per block of the prompt hashes sent "
                                   "for prefix-aware routing: the executors' --block-size (0: send none)."),
    result_cache_size: int = ResultCacheSizeOpt,
    result_cache_ttl_s: float = typer.Option(600.0, "--result-cache-ttl-s", min=0.001,
                                             help="Seconds a result-cache entry lives."),
    task_store: str = TaskStoreOpt,
    task_ttl_s: float = typer.Option(3600.0, "--task-ttl-s", min=0.001, help="Seconds a finished task is kept."),
    max_tasks: int = typer.Option(10_000, "--max-tasks", min=1, help="Most tasks the memory store keeps "
                                  "(finished ones are dropped oldest first; then SubmitTask is refused)."),
    max_unfinished_tasks_per_tenant: int = typer.Option(
        1000, "--max-unfinished-tasks-per-tenant", min=1, help="Most async tasks one tenant may have queued or "
        "running at once, in the task store (shared by the gateways on one Redis); beyond it SubmitTask is "
        "refused with RESOURCE_EXHAUSTED. A tenant's max_unfinished_tasks in the tenants file wins."),
    max_prompt_bytes: int = typer.Option(256 << 10, "--max-prompt-bytes", min=1,
                                         help="Most UTF-8 bytes of a prompt (or of all chat contents)."),
    max_messages: int = typer.Option(1024, "--max-messages", min=1, help="Most chat messages of a request."),
    prefix_cache_scope: str = PrefixCacheScopeOpt,
    result_cache: str = typer.Option("memory", "--result-cache", envvar="MESHSERVE_RESULT_CACHE",
                                     help="Result cache: memory (the LRU of --result-cache-size entries) or "
                                          "redis://host:port/db (shared by gateways)."),
    callback_allow: Optional[list[str]] = typer.Option(None, "--callback-allow", help="A URL prefix task callbacks "
                                                       "may name (repeatable; none: callbacks refused)."),
    callback_secret_file: Optional[str] = typer.Option(None, "--callback-secret-file", help="File holding the "
                                                       "HMAC-SHA256 key that signs callbacks (with --callback-allow)."),
    task_lease_s: float = typer.Option(10.0, "--task-lease-s", min=0.1, help="Seconds a task claim lasts without "
                                       "a heartbeat; then another gateway sharing the store takes the task over."),
    task_max_attempts: int = typer.Option(3, "--task-max-attempts", min=1, help="Most attempts of one task "
                                          "(retries after its executor or gateway went away)."),
    task_max_wait_s: float = typer.Option(600.0, "--task-max-wait-s", min=0.001, help="Longest a task waits out "
                                          "the scheduler's refusals (rate limits, a full queue) before it fails."),
    drain_grace_s: float = typer.Option(30.0, "--drain-grace-s", min=0.0,
                                        help="On SIGTERM or SIGINT: seconds to let the calls in flight (gRPC and "
                                             "HTTP) and the running tasks finish, refusing new calls; the calls "
                                             "still running then end UNAVAILABLE (HTTP 503), retryable, and it "
                                             "hands back the tasks left and exits."),
    http_body_timeout_s: float = typer.Option(30.0, "--http-body-timeout-s", min=0.001,
                                              help="HTTP: the longest wait for the next part of a request body "
                                                   "that has not all arrived; then 408 and the connection closes."),
    traces: Optional[str] = TracesOpt, otlp_endpoint: Optional[str] = OtlpOpt,
    trace_sample_ratio: Optional[float] = SampleOpt,
    metrics_port: Optional[int] = MetricsPortOpt,
    health_port: Optional[int] = HealthPortOpt,
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
    log_level: str = typer.Option("info"),
) -> None:
    """Run the public gateway."""
    from gateway.task_store_registry import task_store_kind
    from meshserve.cli import processes
    from meshserve.urls import redact_url

    try:
        task_store_kind(task_store)
        _check_scope(prefix_cache_scope)
        if result_cache != "memory" and not result_cache.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--result-cache must be 'memory' or a redis://host:port/db URL, "
                             f"got {redact_url(result_cache)!r}")
        if callback_allow:
            from gateway.callbacks import CallbackPolicy

            CallbackPolicy(callback_allow)
            if not callback_secret_file:
                raise ValueError("--callback-allow needs --callback-secret-file (the key that signs callbacks)")
    except ValueError as exc:  # a usage error, exit code 2
        raise typer.BadParameter(str(exc)) from None
    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure)
    setup_logging(log_level)
    export_trace_settings(traces, otlp_endpoint, trace_sample_ratio)
    model_source = processes.ModelSource(model, revision, tokenizer, chat_template, tuple(served_model_name or ()))
    serve(processes.run_gateway(model_source, port, host, scheduler, tenants, block_size, result_cache_size,
                                result_cache_ttl_s, task_store, task_ttl_s, max_tasks, metrics_port, tls,
                                max_prompt_bytes, max_messages, prefix_cache_scope, result_cache,
                                callback_allow, callback_secret_file, task_lease_s, task_max_attempts, http_port,
                                health_port, task_max_wait_s, drain_grace_s,
                                max_unfinished_tasks_per_tenant=max_unfinished_tasks_per_tenant,
                                http_body_timeout_s=http_body_timeout_s))


def _check_scope(scope: str) -> None:
    """Raises ``typer.BadParameter`` for an unknown ``--prefix-cache-scope``."""
    from meshserve.block_hash import cache_salt

    try:
        cache_salt(scope, "")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

