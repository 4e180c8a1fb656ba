"""The Executor gRPC servicer, and the start of an executor's services.

A thin layer over ``executor.engine.AsyncEngine``: ``Execute`` checks the
request once (``LLMEngine.check_request``: the executor's boundary, it does not
trust its caller), runs its choices (``AsyncEngine.generate_choices``: one
engine request per choice, merged into one stream) and converts each ``(choice
index, output)`` into a message; cancelling the call aborts every choice in the
engine, which frees their blocks at its next step.

Before anything runs, ``Execute`` checks the request's signed lease
(``meshserve.lease_token.LeaseVerifier``: the scheduler's signature, this
executor, the request id, the tenant, the expiry, used once): a bad one is
refused with PERMISSION_DENIED, nothing is allocated. The engine request id is
``scoped_request_id(tenant, request_id)``, so tenants' ids never collide, and
the lease's priority (the tenant's ceiling applied) is the one the engine uses.
The request's chain hashes are salted with the lease's tenant (``--prefix-cache-scope
tenant``) and the caller's own ``cache_salt`` (``meshserve.block_hash.cache_salt``):
the gateway can choose the salt, never the tenant part.

Its link to the scheduler is ``executor.scheduler_link.SchedulerLink``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import grpc

from executor.engine.async_engine import DEFAULT_MAX_BUFFERED_OUTPUTS, AsyncEngine
from executor.engine.llm_engine import LLMEngine
from executor.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from executor.health import StepWatchdog
from executor.request_span import ExecuteSpans
from executor.scheduler_link import LinkConfig, SchedulerLink
from meshserve.block_hash import cache_salt, check_cache_salt
from meshserve.errors import AlreadyExists, InvalidArgument, Unavailable
from meshserve.grpc_server import Service
from meshserve.lease_token import LeaseVerifier
from meshserve.request_ids import check_request_id, scoped_request_id
from meshserve.sampling import SamplingParams, params_from_proto
from meshserve.telemetry import context_from_grpc
from meshserve.timeouts import wait_for
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

LEASE_KEY_WAIT_S = 5.0  # how long an Execute that came before the RegisterAck waits for the scheduler's key

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Serves Execute and Stats over one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, model_id: str, executor_id: str = "", prefix_cache_scope: str = "tenant"):
        self.engine = engine
        cache_salt(prefix_cache_scope, "")  # validates
        self.prefix_cache_scope = prefix_cache_scope  # tenant: prefix KV shared within the lease's tenant only
        self.model_id = model_id
        self.executor_id = executor_id  # the registry's id (set by start_executor), for spans
        self.leases = LeaseVerifier(executor_id)  # its key comes with the scheduler's RegisterAck
        self.active_leases: dict[str, str] = {}  # scoped request id -> lease_id
        self.refusal = ""  # set by refuse_new when the executor's drain ended: every later Execute gets it

    def refuse_new(self, message: str) -> None:
        """From now on ``Execute`` ends UNAVAILABLE with ``message`` before it checks
        anything (``executor.drain``: the executor is leaving; a late call is retried
        elsewhere instead of running until the server's stop cancels it)."""
        self.refusal = message

    async def Execute(self, request: executor_pb2.ExecuteRequest, context: grpc.aio.ServicerContext):
        if self.refusal:
            raise Unavailable(self.refusal)
        eng = self.engine.engine
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        check_request_id(request.request_id)
        # the scheduler routes here once it registered us; its RegisterAck, with the key,
        # may still be on its way on the Connect stream (seen on a loaded host): wait for it
        await self.leases.wait_for_key(LEASE_KEY_WAIT_S)
        if self.refusal:  # the drain ended while this call waited for the key
            raise Unavailable(self.refusal)
        claims = self.leases.verify(request.lease, request.request_id, request.tenant)  # PERMISSION_DENIED
        engine_id = scoped_request_id(request.tenant, request.request_id)
        if engine_id in self.active_leases:
            raise AlreadyExists(f"request_id {request.request_id!r} is already in use by an unfinished request")
        # the one check of this request in the executor: INVALID_ARGUMENT before any choice starts
        params = params_from_proto(request.sampling)
        if params.structured_output is None:
            checked = eng.check_request(request.prompt_token_ids, params)
        else:  # compiling its grammar can take longer than a token's step: off the loop
            checked = await asyncio.to_thread(eng.check_request, request.prompt_token_ids, params)
            if engine_id in self.active_leases:  # the same id came in while this one compiled
                raise AlreadyExists(f"request_id {request.request_id!r} is already in use by an unfinished request")
        check_cache_salt(request.cache_salt or None)
        salt = cache_salt(self.prefix_cache_scope, claims.tenant, request.cache_salt)
        checked = dataclasses.replace(checked, cache_salt=salt,
                                      sampling_params=within_lease(checked.sampling_params, claims.max_tokens))
        spans = ExecuteSpans(context_from_grpc(context), request.request_id, self.executor_id, self.model_id,
                             len(checked.prompt_token_ids), checked.sampling_params, claims.priority)
        self.active_leases[engine_id] = claims.lease_id
        failure = None
        try:
            async with contextlib.aclosing(self.engine.generate_choices(engine_id, checked,
                                                                        claims.priority, spans.context)) as choices:
                async for index, out in choices:
                    spans.on_output(index, out)
                    yield response_to_proto(index, out)
        except Exception as exc:
            failure = exc
            raise
        finally:
            spans.end(failure)
            self.active_leases.pop(engine_id, None)

    async def Stats(self, request, context) -> executor_pb2.StatsResponse:
        return stats_to_proto(self.engine.stats(), self.model_id)


def response_to_proto(index: int, out: RequestOutput) -> executor_pb2.ExecuteResponse:
    """One engine output of choice ``index`` as an ``ExecuteResponse``."""
    msg = executor_pb2.ExecuteResponse(
        token_ids=out.new_token_ids,
        finish_reason=FINISH_REASONS.get(out.finish_reason or "", 0) if out.finished else 0,
        num_cached_tokens=out.num_cached_tokens,
        index=index,
        num_kvstore_tokens=out.num_kvstore_tokens,
    )
    if out.logprobs:
        msg.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    return msg


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    """A ``TokenLogprob`` as its proto message."""
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)])


def stats_to_proto(s: EngineStats, model_id: str) -> executor_pb2.StatsResponse:
    """Copies engine counters into a ``StatsResponse``."""
    return executor_pb2.StatsResponse(
        num_blocks=s.num_blocks,
        num_free_blocks=s.num_free_blocks,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_steps=s.num_steps,
        num_joined_running_batch=s.num_joined_running_batch,
        num_finished=s.num_finished,
        num_aborted=s.num_aborted,
        block_size=s.block_size,
        max_model_len=s.max_model_len,
        model=model_id,
        num_preemptions=s.num_preemptions,
        prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
        kv_cache_utilization=s.kv_cache_utilization,
        num_cached_free_blocks=s.num_cached_free_blocks,
        num_prompt_tokens=s.num_prompt_tokens,
        num_generation_tokens=s.num_generation_tokens,
        kvstore_hit_tokens=s.kvstore_hit_tokens,
        kvstore_queried_tokens=s.kvstore_queried_tokens,
        **_connector_stats(s.kvstore),
    )


def _connector_stats(c) -> dict:
    """The kvstore connector's counters as ``StatsResponse`` fields (none without one)."""
    if c is None:
        return {}
    return dict(kvstore_fetched_blocks=c.fetched_blocks, kvstore_bytes_in=c.bytes_in,
                kvstore_fetch_failures=c.fetch_failures, kvstore_corrupt_blocks=c.corrupt_blocks,
                kvstore_fetch_seconds=c.fetch_seconds, kvstore_fetches=c.fetches,
                kvstore_published_blocks=c.published_blocks, kvstore_bytes_out=c.bytes_out,
                kvstore_publish_dropped_blocks=c.publish_dropped_blocks)


def within_lease(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """``params`` with ``max_tokens`` (and ``min_tokens``) at most the lease's bound
    (``LeaseClaims.max_tokens``: what its tenant's KV quota holds; 0: none)."""
    if not max_tokens or params.max_tokens <= max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))


def bind_executor_service(port: int, host: str = "127.0.0.1", tls: TLSConfig = PLAINTEXT,
                          health_port: int | None = None, metrics_port: int | None = None) -> Service:
    """The executor's ``Service``, its ports bound (not yet serving: a call waits until
    ``start_executor`` starts it). Bound before the model loads, a port chosen for the
    executor is not taken by another process meanwhile. With ``metrics_port`` (0: a free
    one) ``/metrics`` serves at once, the process metrics alone until ``start_executor``
    adds the engine's.

    Raises:
        OSError: ``port``, ``health_port`` or ``metrics_port`` cannot be bound.
    """
    metrics = None
    if metrics_port is not None:  # bound first: it stops at once if the gRPC port cannot be bound
        from meshserve.metrics import MetricsServer, new_registry

        metrics = MetricsServer(new_registry("executor"), metrics_port, host)
    try:
        service = Service("meshserve.v1.Executor", port, host, tls, health_port=health_port)
    except BaseException:
        if metrics is not None:
            metrics.stop()
        raise
    service.metrics = metrics
    return service


async def start_executor(
    engine: LLMEngine,
    port: int,
    host: str = "127.0.0.1",
    scheduler_address: str | None = None,
    executor_id: str | None = None,
    pool: str = "default",
    advertise_address: str | None = None,
    step_timeout_s: float = 60.0,
    kvstore_address: str | None = None,
    kvstore_fetch_timeout_s: float = 5.0,
    metrics_port: int | None = None,
    peak_flops: float | None = None,
    max_buffered_outputs: int = DEFAULT_MAX_BUFFERED_OUTPUTS,
    tls: TLSConfig = PLAINTEXT,
    prefix_cache_scope: str = "tenant",
    started_at: float | None = None,
    health_port: int | None = None,
    service: Service | None = None,
) -> tuple[Service, AsyncEngine, SchedulerLink | None]:
    """Starts the engine thread, the Executor service and its scheduler link.

    With ``kvstore_address`` the engine shares prefix blocks through a
    ``KVStoreConnector`` (closed when the engine stops); the kvstore need not be
    up: fetches then fail and the engine recomputes.

    Health is SERVING once the engine runs (and, with a scheduler, once registered).
    If the engine thread dies, health turns NOT_SERVING and the scheduler link
    closes, so no request is routed here any more; a step running longer than
    ``step_timeout_s`` seconds does the same until it returns (``StepWatchdog``,
    kept as ``service.watchdog``). A parallel group's rank that dies does the same
    at once, even while the engine is idle (``StepWatchdog.worker_failed``).

    With ``metrics_port`` (0: a free one) it serves Prometheus metrics
    (``executor.metrics``; ``peak_flops``: the MFU's peak FLOP/s) as ``service.metrics``.

    ``max_buffered_outputs``: outputs a request's reader may leave untaken before the
    request ends with RESOURCE_EXHAUSTED and is aborted (``AsyncEngine``).
    ``started_at``: ``time.monotonic()`` when the process began; the registration
    reports the cold start from it (``ExecutorRegister.startup_s``). To stop it
    gracefully, ``executor.drain.drain`` before stopping.

    ``tls``: the executor's certificate (role executor) for its port and for its
    channels to the scheduler and the kvstore, or plaintext.
    ``prefix_cache_scope``: ``tenant`` (prefix KV blocks shared only between requests
    of the same tenant, the lease's) or ``global`` (``meshserve.block_hash.cache_salt``;
    either way, a request's own ``cache_salt`` narrows the sharing to requests with it).
    ``health_port``: a plaintext health-only port (``Service``; None: none).
    ``service``: the executor's ``Service``, already bound (``bind_executor_service``;
    None: bound here, from ``port``, ``host``, ``tls`` and ``health_port``); when it
    serves metrics already, the engine's join them (``metrics_port`` is then unused).

    Raises:
        TimeoutError: the scheduler did not accept the registration within 60 s.
    """
    if service is None:
        service = bind_executor_service(port, host, tls, health_port)
    if kvstore_address and engine.kv_connector is None:
        from executor.kvstore_connector import KVStoreConnector

        engine.set_kv_connector(KVStoreConnector(kvstore_address, engine.kv_store_fingerprint,
                                                 fetch_timeout_s=kvstore_fetch_timeout_s, tls=tls))
    links: list[SchedulerLink] = []
    async_engine = AsyncEngine(engine, on_stats=lambda _stats: [link.notify() for link in links],
                               on_kv_events=lambda events: [link.on_kv_events(events) for link in links],
                               max_buffered_outputs=max_buffered_outputs)
    if metrics_port is not None or service.metrics is not None:
        from executor.metrics import executor_registry

        registry = executor_registry(async_engine.stats, engine.num_params, engine.config.device, peak_flops,
                                     slow_reader_aborts=lambda: async_engine.num_overflowed,
                                     registry=service.metrics.registry if service.metrics else None)
        if service.metrics is None:
            service.serve_metrics(registry, metrics_port)
    await async_engine.start()
    servicer = ExecutorServicer(async_engine, engine.model_id, prefix_cache_scope=prefix_cache_scope)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    await service.start()
    executor_id = servicer.executor_id = servicer.leases.executor_id = executor_id or f"executor-{service.port}"
    link = None
    if scheduler_address:
        link = SchedulerLink(
            LinkConfig(scheduler_address, executor_id,
                       advertise_address or service.address, pool, tls=tls, started_at=started_at),
            servicer,
        )
        links.append(link)
        link.start()
        try:
            await wait_for(link.connected.wait(), 60)
        except asyncio.TimeoutError:
            await link.stop()
            await service.stop(0)
            raise TimeoutError(f"the scheduler at {scheduler_address} did not accept the registration "
                               "within 60 s (is it running and reachable?)") from None
    await service.set_serving(True)
    service.servicer = servicer  # type: ignore[attr-defined]

    watchdog = StepWatchdog(async_engine, service, link, step_timeout_s)
    on_rank_failure = getattr(engine.worker_group, "on_failure", None)  # a parallel group (multiproc_group)
    if on_rank_failure is not None:
        loop = asyncio.get_running_loop()
        on_rank_failure(lambda reason: loop.call_soon_threadsafe(watchdog.worker_failed, reason))
    watchdog.start()
    service.watchdog = watchdog  # type: ignore[attr-defined]
    return service, async_engine, link
