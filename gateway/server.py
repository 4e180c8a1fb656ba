"""The public Gateway servicer.

``SubmitTask``/``GetTask``/``CancelTask`` (``gateway.task_api``) run the same
generation in the background. Both paths look the result cache up first
(``gateway.result_cache``; deterministic requests only) and fill it when every
choice completed.

``Generate``: authenticate (API key → tenant), build the prompt token ids, validate
the sampling parameters, ask the scheduler for an executor (streaming queue
updates to the caller), stream tokens from the executor through the incremental
detokenizer and the stop-string matcher, then send usage and timings. When a stop
string matches, the caller goes away or anything fails, the executor call is
cancelled (the engine frees the request's blocks) and the lease is released.

With ``n`` choices the executor stream interleaves them; each choice has its own
detokenizer and stop-string matcher (``gateway.choices``), its deltas carry its
index, and it ends with its own ``GenerateResult`` as soon as it is done. The
stream ends after the last choice's result; only then is the executor call
cancelled (a choice cut by a stop string meanwhile runs on, its tokens dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from gateway.choices import Choice, RequestTimer
from gateway.collector import ChoiceCollector, replay
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.prompt import PromptBuilder
from gateway.readiness import ReadinessProbe
from gateway.result_cache import ResultCache, cache_key, is_deterministic
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import Tenant, TenantRegistry
from meshserve import trace_attributes as ta
from meshserve.block_hash import routing_block_hashes
from meshserve.errors import AlreadyExists, InvalidArgument, Unavailable, from_rpc_error
from meshserve.grpc_server import CHANNEL_OPTIONS, TOKEN_STREAM_CHANNEL_OPTIONS, Service
from meshserve.sampling import SamplingParams, from_proto, to_proto
from meshserve.telemetry import context_from_grpc, outgoing_metadata, record_error, tracer
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the model it fronts.

    Attributes:
        model_id: the model id executors register with.
        max_model_len: longest prompt + output (tokens).
        vocab_size: token ids are in [0, vocab_size).
        revision: the weights' revision (``meshserve.model_files``); with the
            model id it roots the prompt's routing chain hashes, so it must be
            the executors' (both resolve the same model files).
    """

    model_id: str
    max_model_len: int
    vocab_size: int
    revision: str = ""


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to run (Generate's or a task's).

    Attributes:
        request_id: its id (claimed in the gateway until ``finish``).
        tenant: the tenant's name.
        prompt_ids: the prompt's token ids.
        params: validated sampling parameters.
        priority: the priority class (the tenant's default when unset).
        cache_key: the result-cache key; None when the cache is off or the
            request is not deterministic.
        metrics: its observations (``gateway.metrics``).
    """

    request_id: str
    tenant: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    metrics: RequestMetrics
    cache_key: str | None = None


def _priority(request: gateway_pb2.GenerateRequest, tenant: Tenant) -> int:
    """The request's priority class: its own, else its tenant's default."""
    return request.priority if request.HasField("priority") else tenant.default_priority


def _prompt_ids(builder: PromptBuilder, request: gateway_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return builder.from_text(request.prompt)
    if kind == "chat":
        return builder.from_chat([(m.role, m.content) for m in request.chat.messages])
    if kind == "prompt_token_ids":
        return builder.from_token_ids(list(request.prompt_token_ids.ids))
    raise InvalidArgument("one of prompt, chat or prompt_token_ids must be set")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and the async task API for one model through the scheduler
    and its executors.

    Args:
        result_cache: the result cache of deterministic requests (None: off).
        tasks: the task runner over its store (None: an in-memory store with
            default TTL and bound).
        metrics: the Prometheus metrics (None: a new ``GatewayMetrics``).
    """

    def __init__(self, tokenizer, model: ModelInfo, tenants: TenantRegistry, scheduler_address: str,
                 hash_block_size: int = 16, result_cache: ResultCache | None = None,
                 tasks: TaskRunner | None = None, metrics: GatewayMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics or GatewayMetrics()
        self.hash_block_size = hash_block_size  # 0: send no block hashes (no prefix-aware routing)
        self.prompts = PromptBuilder(tokenizer)
        self.model = model
        self.tenants = tenants
        self._scheduler_channel = grpc.aio.insecure_channel(scheduler_address, options=CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._executors: dict[str, executor_pb2_grpc.ExecutorStub] = {}
        self._channels: list[grpc.aio.Channel] = [self._scheduler_channel]
        self._in_flight: set[str] = set()  # request ids of unfinished Generate calls
        self.readiness: ReadinessProbe | None = None  # set by start_gateway
        self.result_cache = result_cache
        self.tasks = TaskAPI(self, tasks or TaskRunner(MemoryTaskStore()))

    def _executor(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        stub = self._executors.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=TOKEN_STREAM_CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._executors[address] = executor_pb2_grpc.ExecutorStub(channel)
        return stub

    async def close(self) -> None:
        if self.readiness is not None:
            await self.readiness.stop()
        await self.tasks.close()
        for channel in self._channels:
            await channel.close()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        timer = RequestTimer()
        tenant = self.tenants.authenticate(context.invocation_metadata())
        span = self.request_span(request, context_from_grpc(context), trace.SpanKind.SERVER, stream=True)
        rm = self.start_metrics(request, tenant, timer)
        prepared, error = None, None
        try:
            prepared = self.prepare(request, tenant, rm)
            self.describe(span, prepared)
            async for msg in self.run(prepared, span, timer):
                yield msg
        except Exception as exc:
            record_error(span, exc)
            error = exc
            raise
        except BaseException as exc:  # the caller went away (CancelledError, GeneratorExit)
            error = exc
            raise
        finally:
            rm.end(time.monotonic(), error)
            if prepared is not None:
                self.finish(prepared)
            span.end()

    async def SubmitTask(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        return await self.tasks.submit(request, context)

    async def GetTask(self, request: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext):
        return await self.tasks.get(request, context)

    async def CancelTask(self, request: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext):
        return await self.tasks.cancel(request, context)

    def request_span(self, request: gateway_pb2.GenerateRequest, parent, kind: trace.SpanKind, stream: bool):
        """Starts the span of one generation, named by the GenAI convention, child of ``parent``."""
        operation = ta.operation_name(request.WhichOneof("input"))
        return _tracer.start_span(ta.span_name(operation, self.model.model_id), context=parent, kind=kind,
                                  attributes={ta.OPERATION_NAME: operation, ta.REQUEST_MODEL: self.model.model_id,
                                              ta.REQUEST_STREAM: stream})

    def start_metrics(self, request: gateway_pb2.GenerateRequest, tenant: Tenant,
                      timer: RequestTimer) -> RequestMetrics:
        """Begins observing an authenticated request (valid or not); the caller ends it."""
        return self.metrics.start(tenant.name, _priority(request, tenant), timer.start)

    def prepare(self, request: gateway_pb2.GenerateRequest, tenant: Tenant, metrics: RequestMetrics) -> Prepared:
        """Validates the request and claims its request id: the checks Generate and
        SubmitTask both make before anything runs. The caller calls ``finish`` when done;
        ``metrics`` (from ``start_metrics``) follows it.

        Raises:
            InvalidArgument: a bad parameter or prompt.
            AlreadyExists: the request id is in use by an unfinished request.
        """
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._in_flight:
            raise AlreadyExists(f"request_id {request_id!r} is already in use by an unfinished request")
        prompt_ids = _prompt_ids(self.prompts, request)
        params = from_proto(request.sampling, max_model_len=self.model.max_model_len, vocab_size=self.model.vocab_size)
        if len(prompt_ids) + 1 > self.model.max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.model.max_model_len} "
                "(prompt + at least 1 output token)"
            )
        priority = _priority(request, tenant)
        metrics.num_prompt_tokens = len(prompt_ids)
        key = None
        if self.result_cache is not None and is_deterministic(params):
            key = cache_key(self.model.model_id, self.model.revision, prompt_ids, params)
        self._in_flight.add(request_id)
        return Prepared(request_id, tenant.name, prompt_ids, params, priority, metrics, key)

    def finish(self, prepared: Prepared) -> None:
        """Frees the request id ``prepare`` claimed."""
        self._in_flight.discard(prepared.request_id)

    @staticmethod
    def describe(span, p: Prepared) -> None:
        """The request's attributes on its span."""
        span.set_attributes({ta.REQUEST_ID: p.request_id, ta.TENANT: p.tenant, ta.PRIORITY: p.priority,
                             ta.USAGE_INPUT_TOKENS: len(p.prompt_ids), **ta.sampling_attributes(p.params)})

    async def run(self, p: Prepared, span, timer: RequestTimer, on_assigned=None):
        """Generates a prepared request: the Generate stream's messages.

        A deterministic request with the result cache on is answered from the cache
        when it holds the same request's output (no scheduler, no executor), else run
        and, when every choice completes, stored. ``on_assigned()`` (a coroutine
        function) is awaited once the scheduler has assigned an executor.

        Raises:
            MeshError: the scheduler's or the executor's error (same code).
        """
        if p.cache_key is not None:
            cached = self.result_cache.get(p.cache_key)
            span.set_attribute(ta.RESULT_CACHE_HIT, cached is not None)
            if cached is not None:
                choices = [gateway_pb2.TaskChoice.FromString(data) for data in cached]
                p.metrics.first_token(time.monotonic())
                p.metrics.tokens(sum(len(c.token_ids) for c in choices))
                for msg in replay(choices, p.request_id, timer.start):
                    yield msg
                span.set_attributes({ta.USAGE_OUTPUT_TOKENS: sum(len(c.token_ids) for c in choices),
                                     ta.RESPONSE_ID: p.request_id, ta.RESPONSE_MODEL: self.model.model_id,
                                     ta.RESPONSE_FINISH_REASONS: ta.finish_reasons(
                                         [c.result.finish_reason for c in choices])})
                return
        collector = ChoiceCollector() if p.cache_key is not None else None
        async for msg in self._generate(p, span, timer, on_assigned):
            if collector is not None:
                collector.feed(msg)
            yield msg
        if collector is not None and collector.complete(p.params.n):
            self.result_cache.put(p.cache_key, tuple(c.SerializeToString() for c in collector.choices()))

    async def _generate(self, p: Prepared, span, timer: RequestTimer, on_assigned):
        request_id, prompt_ids, params, priority = p.request_id, p.prompt_ids, p.params, p.priority
        admit = scheduler_pb2.AdmitRequest(
            request_id=request_id,
            tenant=p.tenant,
            priority=priority,
            num_prompt_tokens=len(prompt_ids),
            max_tokens=params.max_tokens,
            model=self.model.model_id,
            n=params.n,
        )
        if self.hash_block_size > 0:
            admit.block_hashes.extend(routing_block_hashes(prompt_ids, self.hash_block_size, self.model.model_id,
                                                           self.model.revision))
            admit.hash_block_size = self.hash_block_size
        assignment, queued = None, False
        try:
            async for event in self.scheduler.Admit(admit, metadata=outgoing_metadata(span)):
                if event.WhichOneof("kind") == "queued":
                    q = event.queued
                    if not queued:  # the position at which it joined the queue
                        queued = True
                        span.set_attribute(ta.QUEUE_POSITION, q.position)
                    yield gateway_pb2.GenerateResponse(
                        queue=gateway_pb2.QueueUpdate(position=q.position, estimated_wait_s=q.estimated_wait_s)
                    )
                else:
                    assignment = event.assignment
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "scheduler") from None
        if assignment is None:
            raise Unavailable("scheduler ended admission without an assignment")
        timer.assigned = time.monotonic()
        p.metrics.assigned(timer.assigned)
        span.set_attributes({ta.EXECUTOR_ID: assignment.executor_id, ta.QUEUE_WAIT_S: assignment.queue_s})
        finished: dict[str, int] = {}  # completion tokens, once every choice is done
        try:
            if on_assigned is not None:
                await on_assigned()
            async for msg in self._execute(request_id, prompt_ids, params, priority, assignment, timer, span,
                                           finished, p.metrics):
                yield msg
        finally:
            await self._release(assignment.lease_id, finished.get("completion_tokens"), span)

    async def _execute(self, request_id, prompt_ids, params, priority, assignment, timer, span, finished,
                       rm: RequestMetrics):
        exe = executor_pb2.ExecuteRequest(
            request_id=request_id, lease_id=assignment.lease_id, prompt_token_ids=prompt_ids, priority=priority
        )
        to_proto(params, exe.sampling)
        choices = [Choice(i, self.tokenizer, prompt_ids, params.stop) for i in range(params.n)]
        call = self._executor(assignment.address).Execute(exe, metadata=outgoing_metadata(span))
        try:
            async for out in call:
                if not 0 <= out.index < len(choices):
                    raise Unavailable(f"executor {assignment.executor_id} sent choice {out.index} of {params.n}")
                choice = choices[out.index]
                if choice.done:
                    continue  # cut by a stop string; the executor runs it until all choices end
                now = time.monotonic()
                if out.token_ids and not timer.first_token:
                    timer.first_token = now
                    span.add_event(ta.EVENT_FIRST_TOKEN)
                    rm.first_token(now)
                rm.tokens(len(out.token_ids))
                yield gateway_pb2.GenerateResponse(delta=choice.feed(out, now))
                if choice.done:
                    rm.choice_done(choice.num_tokens, choice.first_token, choice.last_token)
                    yield gateway_pb2.GenerateResponse(
                        result=choice.result(request_id, prompt_ids, assignment.executor_id, timer))
                if all(c.done for c in choices):
                    break
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"executor {assignment.executor_id}") from None
        finally:
            call.cancel()  # no-op when finished; aborts the engine requests otherwise
        if not all(c.done for c in choices):
            raise Unavailable(f"executor {assignment.executor_id} ended the stream without finishing")
        finished["completion_tokens"] = sum(c.num_tokens for c in choices)
        span.set_attributes({ta.USAGE_OUTPUT_TOKENS: finished["completion_tokens"],
                             ta.USAGE_CACHE_READ_INPUT_TOKENS: choices[0].num_cached_tokens,
                             ta.RESPONSE_ID: request_id, ta.RESPONSE_MODEL: self.model.model_id,
                             ta.RESPONSE_FINISH_REASONS: ta.finish_reasons([c.finish_reason for c in choices])})

    async def _release(self, lease_id: str, num_completion_tokens: int | None = None, span=None) -> None:
        """Ends the lease; the completion tokens (when every choice finished) teach the scheduler's predictor.
        ``span``: the request's span, parent of the scheduler's ``scheduler.release``."""
        release = scheduler_pb2.ReleaseRequest(lease_id=lease_id)
        if num_completion_tokens is not None:
            release.num_completion_tokens = num_completion_tokens
        try:
            await asyncio.shield(self.scheduler.Release(release, timeout=5, metadata=outgoing_metadata(span)))
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - shutting down or scheduler gone
            log.warning("release of lease %s failed: %s", lease_id, exc)


async def start_gateway(
    tokenizer, model: ModelInfo, scheduler_address: str, port: int, host: str = "127.0.0.1",
    tenants: TenantRegistry | None = None, hash_block_size: int = 16,
    result_cache: ResultCache | None = None, tasks: TaskRunner | None = None, metrics_port: int | None = None,
) -> Service:
    """Starts the Gateway service. Its health is SERVING while the scheduler has an
    executor registered (``gateway.readiness``), checked every 0.5 s.

    ``hash_block_size``: tokens per block of the prompt chain hashes sent for
    prefix-aware routing (the executors' ``block_size``; 0: none sent).
    ``result_cache``: the result cache (None: off). ``tasks``: the async task
    runner over its store (None: in memory, defaults).
    ``metrics_port``: serve Prometheus metrics (``gateway.metrics``) there (0: a
    free port; None: none), as ``service.metrics``.
    """
    service = Service("meshserve.v1.Gateway", port, host)
    servicer = GatewayServicer(tokenizer, model, tenants or TenantRegistry.open(), scheduler_address,
                               hash_block_size, result_cache, tasks)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, service.server)
    service.servicer = servicer  # type: ignore[attr-defined]
    service.serve_metrics(servicer.metrics.registry, metrics_port)
    await service.start()
    servicer.readiness = ReadinessProbe(service, servicer._scheduler_channel)
    await servicer.readiness.check()
    servicer.readiness.start()
    return service
