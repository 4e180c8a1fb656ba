"""Each service's process: load what it needs, serve, stop cleanly on a signal.

``run_scheduler``, ``run_executor``, ``run_kvstore`` and ``run_gateway`` are what
``meshserve scheduler|executor|kvstore|gateway`` run (one service per container); ``meshserve up``
starts them as separate processes (``meshserve.cli.launcher``). Tests call the
``start_*`` functions of each service in one process instead. Each takes the
process's ``meshserve.tls.TLSConfig`` (``tls``: mutual TLS or plaintext).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.callbacks import CallbackPolicy, CallbackSender
from gateway.prompt_limits import PromptLimits
from gateway.request import ModelInfo
from gateway.result_cache import ResultCache
from gateway.result_store import RedisResultStore
from gateway.server import start_gateway, stop_gateway
from gateway.task_runner import DEFAULT_MAX_UNFINISHED_PER_TENANT, TaskRunner
from gateway.task_store_registry import open_task_store
from gateway.tenants import TenantRegistry
from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.cli.options import parse_bytes
from meshserve.grpc_server import run_until_signal
from meshserve.model_files import eos_token_ids, resolve_model
from meshserve.telemetry import setup_tracing, shutdown_tracing
from meshserve.tls import PLAINTEXT, TLSConfig
from scheduler.config import SchedulerConfig
from scheduler.placement import KV_RESERVATIONS
from scheduler.pools import PoolsConfig
from scheduler.queue_policy import QueuePolicy
from scheduler.routing import RoutingConfig
from scheduler.server import start_scheduler
from scheduler.tenant_limits import TenantLimits

if TYPE_CHECKING:
    from executor.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """What the gateway serves, as its flags name it (vLLM's spellings).

    Attributes:
        model: ``--model``: alias, path or Hugging Face id (``meshserve.model_files``).
        revision: ``--revision`` of a Hugging Face id (None: main).
        tokenizer: ``--tokenizer``: a folder or Hugging Face id (None: the model's).
        chat_template: ``--chat-template``: a file, or the Jinja template itself (None: the tokenizer's).
        served_model_names: ``--served-model-name``s (empty: the model's id).
    """

    model: str = "default"
    revision: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    served_model_names: tuple[str, ...] = ()


def model_info(model: str | ModelSource):
    """Tokenizer and ``ModelInfo`` for the gateway (limits read from the model config).

    Raises:
        FileNotFoundError: the model or tokenizer cannot be found locally.
    """
    from transformers import AutoConfig, AutoTokenizer  # seconds to import: only when a gateway starts

    source = model if isinstance(model, ModelSource) else ModelSource(model)
    files = resolve_model(source.model, source.revision)
    config = AutoConfig.from_pretrained(files.path)
    max_len = config.max_position_embeddings
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        max_len = min(max_len, config.sliding_window)
    tokenizer_path = files.path if source.tokenizer is None else resolve_model(source.tokenizer).path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if source.chat_template is not None:
        template = Path(source.chat_template)
        tokenizer.chat_template = template.read_text(encoding="utf-8") if template.is_file() \
            else source.chat_template
    return tokenizer, ModelInfo(files.model_id, max_len, config.vocab_size, files.revision, source.served_model_names,
                                eos_token_ids(files.path, config))


def scheduler_config(queue_policy: str = "fcfs", max_queue_wait_s: float = 30.0, max_queue_len: int = 4096,
                     max_queue_tokens: int | None = None, tenants_file: str | None = None,
                     pools_file: str | None = None, routing: RoutingConfig | None = None,
                     kv_reservation: str = "prompt", lease_ttl_s: float = 10.0,
                     start_budget_s: float | None = None) -> SchedulerConfig:
    """The scheduler's ``SchedulerConfig``; tenant KV quotas, the tenants admitted, their
    priority ceilings and rate limits come from the tenants file (without one only the
    ``default`` tenant is admitted, unlimited); ``lease_ttl_s``: a lease's life unless renewed;
    pools from the pools file (``scheduler.pools``); ``routing`` is a ``RoutingConfig``;
    ``kv_reservation`` is ``prompt`` or ``predicted`` (``scheduler.placement``);
    ``start_budget_s``: scale to zero, how long a request waits for a first executor
    (None: UNAVAILABLE at once).

    Raises:
        ValueError: a bad policy name, bound, tenants or pools file.
        FileNotFoundError: no such tenants or pools file.
    """
    QueuePolicy(queue_policy, max_queue_wait_s)  # validates
    if kv_reservation not in KV_RESERVATIONS:
        raise ValueError(f"unknown kv reservation {kv_reservation!r} (choose from {', '.join(KV_RESERVATIONS)})")
    if max_queue_len < 1 or (max_queue_tokens is not None and max_queue_tokens < 1):
        raise ValueError("max_queue_len and max_queue_tokens must be >= 1")
    if lease_ttl_s <= 0:
        raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
    if start_budget_s is not None and not (math.isfinite(start_budget_s) and start_budget_s > 0):
        raise ValueError(f"start_budget_s must be a finite number of seconds > 0, got {start_budget_s}")
    tenants = (TenantRegistry.from_file(tenants_file) if tenants_file else TenantRegistry.open()).tenants
    quotas = {t.name: t.kv_quota_blocks for t in tenants}
    limits = {t.name: TenantLimits(t.max_priority, t.requests_per_s, t.tokens_per_min) for t in tenants}
    pools = PoolsConfig.from_file(pools_file) if pools_file else None
    return SchedulerConfig(max_queue_len=max_queue_len, max_queue_tokens=max_queue_tokens, queue_policy=queue_policy,
                           max_queue_wait_s=max_queue_wait_s, tenant_quotas=quotas, pools=pools,
                           routing=routing or RoutingConfig(), kv_reservation=kv_reservation,
                           lease_ttl_s=lease_ttl_s, tenant_limits=limits, start_budget_s=start_budget_s)


def _health_note(service) -> str:
    """``, health on HOST:PORT`` for a start-up log line, when the service has a health-only port."""
    return f", health on {service.health_address}" if service.health_address else ""


async def run_scheduler(port: int, host: str = "127.0.0.1", config: SchedulerConfig | None = None,
                        kvstore_address: str | None = None, metrics_port: int | None = None,
                        tls: TLSConfig = PLAINTEXT, planner=None, health_port: int | None = None) -> None:
    """Serves the scheduler (``config``: a ``SchedulerConfig``, default settings if None) until SIGINT/SIGTERM;
    with ``kvstore_address`` it follows that kvstore's placements for routing; Prometheus metrics on
    ``metrics_port`` (None: none); ``planner``: the autoscaling planner's ``PlannerConfig`` (None: defaults);
    plaintext grpc.health.v1 alone on ``health_port`` (None: none)."""
    setup_tracing("scheduler")
    holder = {}

    async def start():
        holder["svc"] = await start_scheduler(port, host, config, kvstore_address, metrics_port, tls, planner,
                                              health_port=health_port)
        log.info("scheduler serving on %s%s", holder["svc"].address, _health_note(holder["svc"]))

    async def stop():
        await holder["svc"].stop()
        shutdown_tracing()

    await run_until_signal(start, stop)


async def run_kvstore(port: int, host: str, memory_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0,
                      max_events: int = 65536, metrics_port: int | None = None, tls: TLSConfig = PLAINTEXT,
                      health_port: int | None = None) -> None:
    """Serves a kvstore until SIGINT/SIGTERM (its blocks are a cache: lost at stop); Prometheus
    metrics on ``metrics_port`` (None: none); plaintext grpc.health.v1 alone on ``health_port`` (None: none)."""
    setup_tracing("kvstore")
    holder = {}

    async def start():
        store = KVStore(memory_bytes, disk_dir, disk_bytes if disk_dir else 0, max_events)
        holder["svc"] = await start_kvstore(store, port, host, metrics_port=metrics_port, tls=tls,
                                            health_port=health_port)
        log.info("kvstore serving on %s (memory %d bytes%s)%s", holder["svc"].address, memory_bytes,
                 f", disk {disk_bytes} bytes under {disk_dir}" if disk_dir else "", _health_note(holder["svc"]))

    async def stop():
        await holder["svc"].stop()
        shutdown_tracing()

    await run_until_signal(start, stop)


def engine_config(model: str, dtype: str, kv_cache_memory: str, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int, no_chunked_prefill: bool, max_model_len: int | None,
                  num_threads: int | None, no_prefix_caching: bool = False, max_batch_wait_ms: float = 0.0,
                  attention_backend: str = "auto", device: str = "cpu", enable_kv_events: bool = False,
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                  revision: str | None = None, cuda_graphs: bool | None = None,
                  compile: bool = False, long_prefill_token_threshold: int = 0,
                  short_prefill_tokens: int | None = None, prefill_order: str | None = None) -> EngineConfig:
    """The executor's ``EngineConfig`` from its flags (``kv_cache_memory`` a byte size such as ``2GiB``;
    the parallel sizes: the ranks of one replica, ``executor.worker.multiproc_group``; ``cuda_graphs``
    None: wherever they can run).

    Raises:
        ValueError: a value ``EngineConfig`` or ``parse_bytes`` rejects.
    """
    if long_prefill_token_threshold and no_chunked_prefill:  # named by its flags, not by the config fields
        raise ValueError("--long-prefill-token-threshold needs chunked prefill (it splits prompts into chunks): "
                         "drop --no-chunked-prefill")
    from executor.engine.config import (PREFILL_ORDERS, BatchSchedulerConfig, CacheConfig,  # torch: as run_executor
                                        EngineConfig, ParallelConfig)

    if prefill_order is not None and prefill_order not in PREFILL_ORDERS:  # named by its flag
        raise ValueError(f"--prefill-order must be one of {', '.join(PREFILL_ORDERS)}, got {prefill_order!r}")

    return EngineConfig(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        num_threads=num_threads,
        attention_backend=attention_backend,
        device=device,
        revision=revision,
        cuda_graphs=cuda_graphs,
        compile=compile,
        warm_up=True,
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=parse_bytes(kv_cache_memory),
                          enable_prefix_caching=not no_prefix_caching,
                          enable_kv_events=enable_kv_events and not no_prefix_caching),
        batch=BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=not no_chunked_prefill,
                                   max_batch_wait_ms=max_batch_wait_ms,
                                   long_prefill_token_threshold=long_prefill_token_threshold,
                                   **({} if short_prefill_tokens is None else
                                      {"short_prefill_tokens": short_prefill_tokens}),
                                   **({} if prefill_order is None else {"prefill_order": prefill_order})),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                pipeline_parallel_size=pipeline_parallel_size),
    )


def check_parallel_layout(model: str, revision: str | None, tensor_parallel_size: int,
                          pipeline_parallel_size: int) -> None:
    """Refuses, before anything loads, tensor/pipeline-parallel sizes the model cannot be
    split into (``executor.parallel_layout``: from its config.json, without importing
    torch, so the refusal comes in about a second); nothing to check at 1 × 1.

    Raises:
        ValueError: with the model's head counts and the sizes it allows.
        FileNotFoundError: the model cannot be resolved.
    """
    if tensor_parallel_size * pipeline_parallel_size == 1:
        return
    from executor.parallel_layout import check_parallel_sizes, read_model_shape
    from meshserve.model_files import resolve_model

    check_parallel_sizes(read_model_shape(resolve_model(model, revision).path), tensor_parallel_size,
                         pipeline_parallel_size)


async def run_executor(engine_config: EngineConfig, port: int, host: str, scheduler: str, executor_id: str | None,
                       pool: str = "default", advertise_address: str | None = None,
                       step_timeout_s: float = 60.0, kvstore_address: str | None = None,
                       kvstore_fetch_timeout_s: float = 5.0, metrics_port: int | None = None,
                       peak_flops: float | None = None, max_buffered_outputs: int = 256,
                       tls: TLSConfig = PLAINTEXT, prefix_cache_scope: str = "tenant",
                       drain_grace_s: float = 30.0, health_port: int | None = None) -> None:
    """Loads the model, serves the executor and stays registered until a signal; Prometheus
    metrics on ``metrics_port`` (None: none), the MFU against ``peak_flops`` FLOP/s. A request whose
    reader leaves ``max_buffered_outputs`` messages untaken is ended (RESOURCE_EXHAUSTED).
    On SIGTERM/SIGINT it drains first (``executor.drain``: nothing new is routed here, what runs
    finishes) for at most ``drain_grace_s`` seconds, then stops. Plaintext grpc.health.v1 alone on
    ``health_port`` (None: none)."""
    started_at = time.monotonic()
    from executor.drain import drain
    from executor.engine.llm_engine import LLMEngine  # torch: imported only when an executor starts
    from executor.server import bind_executor_service, start_executor

    setup_tracing("executor")
    holder = {}
    done = asyncio.Event()

    async def start():
        service = bind_executor_service(port, host, tls, health_port, metrics_port)  # held while the model loads
        try:
            engine = await asyncio.to_thread(LLMEngine, engine_config)
            await asyncio.to_thread(engine.grammars.warm)  # before serving: its build holds the GIL for long
        except BaseException:
            await service.stop(0)  # its ports are free again (an in-process caller lives on)
            raise
        svc, async_engine, link = await start_executor(engine, port, host, scheduler, executor_id, pool,
                                                    advertise_address, step_timeout_s, kvstore_address,
                                                    kvstore_fetch_timeout_s, metrics_port, peak_flops,
                                                    max_buffered_outputs, tls=tls,
                                                    prefix_cache_scope=prefix_cache_scope, started_at=started_at,
                                                    health_port=health_port, service=service)
        async_engine.on_failure(lambda _exc: done.set())  # exit non-zero: the orchestrator restarts us
        on_rank_failure = getattr(engine.worker_group, "on_failure", None)  # a parallel group's ranks
        if on_rank_failure is not None:
            loop = asyncio.get_running_loop()
            on_rank_failure(lambda _reason: loop.call_soon_threadsafe(done.set))
        holder.update(svc=svc, engine=async_engine, link=link)
        # the start-up heap (the model's modules, the tokenizer, the grammars) frozen out of the
        # cyclic collector, as vLLM's engine core does: its full collections while serving then
        # skip it (they took 3% of a 2,048-token prefill step's time, `perf record`)
        gc.collect()
        gc.freeze()
        batch = engine.config.batch
        log.info("executor serving on %s (%d KV blocks of %d tokens; prefill order %s, short prefills first up to "
                 "%d tokens)%s", svc.address, engine.num_blocks, engine.block_size, batch.prefill_order,
                 batch.short_prefill_tokens, _health_note(svc))

    async def stop():
        await holder["svc"].watchdog.stop()
        if holder["engine"].failure is None:
            await drain(holder["svc"], holder["svc"].servicer, holder.get("link"), drain_grace_s)
        await holder["svc"].set_serving(False)
        if holder.get("link"):
            await holder["link"].stop()  # leave the registry first: no new assignments
        await holder["svc"].stop()
        await holder["engine"].stop()
        await asyncio.to_thread(holder["engine"].engine.shutdown)  # a parallel group's ranks exit
        shutdown_tracing()

    await run_until_signal(start, stop, done)
    failure = holder["engine"].failure
    if failure is not None:
        raise SystemExit(f"executor stopped: engine thread failed: {type(failure).__name__}: {failure}")
    rank_failure = getattr(holder["engine"].engine.worker_group, "failure", None)
    if rank_failure is not None:
        raise SystemExit(f"executor stopped: {rank_failure}")


async def run_gateway(model: str | ModelSource, port: int, host: str, scheduler: str, tenants_file: str | None = None,
                      hash_block_size: int = 16, result_cache_size: int = 0, result_cache_ttl_s: float = 600.0,
                      task_store: str = "memory", task_ttl_s: float = 3600.0, max_tasks: int = 10_000,
                      metrics_port: int | None = None, tls: TLSConfig = PLAINTEXT, max_prompt_bytes: int = 256 << 10,
                      max_messages: int = 1024, prefix_cache_scope: str = "tenant", result_cache: str = "memory",
                      callback_allow: list[str] | None = None, callback_secret_file: str | None = None,
                      task_lease_s: float = 10.0, task_max_attempts: int = 3, http_port: int | None = None,
                      health_port: int | None = None, task_max_wait_s: float = 600.0,
                      drain_grace_s: float = 30.0,
                      max_unfinished_tasks_per_tenant: int = DEFAULT_MAX_UNFINISHED_PER_TENANT,
                      http_body_timeout_s: float | None = None) -> None:
    """Loads the tokenizer, serves the public Gateway until a signal; then it reports
    NOT_SERVING, refuses new calls and lets the calls in flight (gRPC and HTTP) and the
    running tasks finish for at most ``drain_grace_s`` seconds before it exits
    (``gateway.server.stop_gateway``).

    ``max_prompt_bytes`` / ``max_messages``: prompt caps checked before tokenizing
    (``gateway.prompt_limits``). ``prefix_cache_scope``: as the executors'.

    ``result_cache_size``: entries of the result cache (0: off), each living
    ``result_cache_ttl_s`` seconds. ``task_store``: ``memory`` or a Redis URL;
    finished tasks live ``task_ttl_s`` seconds; the memory store keeps at most
    ``max_tasks``. A Redis unreachable, or unable to serve tasks (older than 6.2, a
    user without ``@scripting``), stops the start with ``ConnectionError``.
    ``result_cache``: ``memory`` (the LRU of ``result_cache_size`` entries) or a
    Redis URL (shared by gateways; ``result_cache_ttl_s``). ``callback_allow``:
    the task callback allow-list, signed with the key in ``callback_secret_file``.
    ``task_lease_s`` / ``task_max_attempts``: a task claim's lease and the most
    attempts of one task (``gateway.task_runner``); ``task_max_wait_s``: the longest
    a task waits out refusals (``gateway.task_wait``); ``max_unfinished_tasks_per_tenant``:
    the most unfinished tasks of a tenant whose tenants-file entry sets no
    ``max_unfinished_tasks`` (``gateway.task_store``).
    Prometheus metrics on ``metrics_port`` (None: none); the OpenAI-compatible HTTP API
    on ``http_port`` (None: none), in the same event loop, waiting at most
    ``http_body_timeout_s`` seconds for each next part of a request body (None: 30 s,
    ``gateway.http.body_guards``); plaintext grpc.health.v1 alone on ``health_port``
    (None: none).
    """
    setup_tracing("gateway")
    holder = {}

    async def start():
        store = open_task_store(task_store, task_ttl_s, max_tasks)
        warning = await store.check_at_start()  # before the tokenizer loads: a Redis unreachable or unfit fails fast
        if warning:
            log.warning("%s", warning)
        tokenizer, info = await asyncio.to_thread(model_info, model)
        tenants = TenantRegistry.from_file(tenants_file) if tenants_file else TenantRegistry.open()
        if result_cache != "memory":
            cache = RedisResultStore(result_cache, result_cache_ttl_s)
        else:
            cache = ResultCache(result_cache_size, result_cache_ttl_s) if result_cache_size > 0 else None
        callbacks = None
        if callback_allow:
            secret = Path(callback_secret_file).read_bytes().strip()
            callbacks = CallbackSender(CallbackPolicy(callback_allow), secret)
        runner = TaskRunner(store, heartbeat_s=task_lease_s / 4, lease_s=task_lease_s,
                            claim_poll_s=min(1.0, task_lease_s / 4), max_attempts=task_max_attempts,
                            max_wait_s=task_max_wait_s, max_unfinished_per_tenant=max_unfinished_tasks_per_tenant)
        holder["svc"] = await start_gateway(tokenizer, info, scheduler, port, host, tenants, hash_block_size,
                                            result_cache=cache, tasks=runner, metrics_port=metrics_port,
                                            callbacks=callbacks, tls=tls,
                                            prompt_limits=PromptLimits(max_prompt_bytes, max_messages),
                                            prefix_cache_scope=prefix_cache_scope, http_port=http_port,
                                            health_port=health_port, http_body_timeout_s=http_body_timeout_s)
        http = holder["svc"].http
        log.info("gateway serving on %s%s%s", holder["svc"].address, f", HTTP on {http.url}" if http else "",
                 _health_note(holder["svc"]))

    async def stop():
        log.info("gateway stopping: new calls refused, %g s for the calls in flight and the running tasks",
                 drain_grace_s)
        await stop_gateway(holder["svc"], drain_grace_s)
        shutdown_tracing()

    await run_until_signal(start, stop)
