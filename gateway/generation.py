"""The gateway core: one request from validation to its last token, with no transport.

``GatewayCore`` owns what a request needs besides its caller: the request
preparation (``gateway.preparation``: checks, the prompt builder over the tokenizer,
the request ids in flight), the run on the mesh (``gateway.mesh_run``: scheduler
Admit/Release, executor Execute through the mesh client, ``gateway.mesh``), the
result cache and the metrics. It takes plain data
(``gateway.request.GenerationRequest``, a ``Tenant``) and yields plain events
(``gateway.events``): ``Queued``, ``Delta``, ``ChoiceResult``. Errors are raised,
never yielded: ``meshserve.errors.MeshError`` subclasses (``InvalidArgument``,
``AlreadyExists``, ``NotFound``, ``Unavailable``, the scheduler's and executors'
codes), each adapter mapping them to its own status.

How an adapter drives it (the gRPC servicer in ``gateway.server``, the task API
in ``gateway.task_api``; an HTTP adapter would do the same)::

    tenant = tenants.authenticate(headers)                 # the adapter's auth → Tenant
    request = GenerationRequest(prompt=..., sampling=SamplingParams(...), request_id=...)
    async with aclosing(core.generate(request, tenant, SpanOptions(parent=ctx))) as events:
        async for event in events:                         # raises MeshError: map it to a status
            send(to_wire(event))                           # Queued / Delta / ChoiceResult

or in two steps, to fail fast and run later (a task): ``prepared =
core.prepare(request, tenant)`` raises at once on a bad request; ``core.run(prepared,
...)`` yields the events; ``core.end(prepared, exc)`` ends a prepared request that
will never run. Cancellation is the adapter's: it cancels the task iterating (or
closes the iterator); the core's ``finally`` blocks cancel the executor call (the
engine frees the request's blocks), release the lease, free the request id, end the
span and observe the metrics exactly once. A request whose id is held by one that is
ending waits for that end instead of being refused (``gateway.preparation``).

Spans (OpenTelemetry, ``meshserve.trace_attributes``): one per request,
``"{operation} {model}"``, child of ``SpanOptions.parent``; its context travels to
the scheduler and executor in the mesh client's calls.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

from opentelemetry import trace

from gateway.choices import KeptStops
from gateway.collector import ChoiceCollector, CompletedChoice, replay
from gateway.events import Delta, Event, FinishReason
from gateway.mesh import MeshClient
from gateway.mesh_run import MeshRunner, OnAssigned, finish_reasons, refused_for_now
from gateway.metrics import GatewayMetrics
from gateway.preparation import RequestPreparer
from gateway.prompt import PromptBuilder
from gateway.prompt_limits import PromptLimits
from gateway.prompt_memo import PromptMemo
from gateway.request import GenerationRequest, ModelInfo, Prepared, SpanOptions
from gateway.result_cache import ResultCache
from gateway.result_store import Coalescer, MemoryResultStore, ResultStore
from gateway.running import RunningRequests
from gateway.tenants import Tenant
from meshserve import trace_attributes as ta
from meshserve.telemetry import record_error, tracer

_tracer = tracer(__name__)


class GatewayCore:
    """Runs requests for one model through the scheduler and its executors.

    Args:
        tokenizer: the model's tokenizer (prompts and detokenization).
        model: the model served.
        mesh: the scheduler and executors (``gateway.mesh_client.GrpcMeshClient``).
        hash_block_size: tokens per block of the prompt chain hashes sent for
            prefix-aware routing (the executors' ``block_size``; 0: none sent).
        result_cache: finished choices of deterministic requests: a ``ResultStore``
            (``gateway.result_store``: memory or Redis) or a ``ResultCache`` (kept
            in memory); None: off. Identical requests in flight are coalesced.
        metrics: the Prometheus metrics (None: a new ``GatewayMetrics``).
        prompt_limits: size limits checked before tokenizing (``gateway.prompt_limits``).
        prefix_cache_scope: ``tenant`` or ``global``, as the executors': the routing
            hashes are salted as they salt their chains (``meshserve.block_hash.cache_salt``:
            with the request's own ``cache_salt``, which travels to the executor).

    Its parts: ``preparer`` (``gateway.preparation.RequestPreparer``: checks, prompt
    ids, the request ids in flight, per tenant) and ``runner``
    (``gateway.mesh_run.MeshRunner``: admission, the executor's stream, the lease).
    """

    def __init__(self, tokenizer, model: ModelInfo, mesh: MeshClient, hash_block_size: int = 16,
                 result_cache: ResultStore | ResultCache[tuple[CompletedChoice, ...]] | None = None,
                 metrics: GatewayMetrics | None = None, prompt_limits: PromptLimits | None = None,
                 prefix_cache_scope: str = "tenant"):
        self.tokenizer = tokenizer
        self.model = model
        if isinstance(result_cache, ResultCache):
            result_cache = MemoryResultStore(result_cache)
        self.result_cache = result_cache
        self.results = Coalescer(result_cache) if result_cache is not None else None
        self.metrics = metrics or GatewayMetrics()
        self.prompts = PromptBuilder(tokenizer)
        self.prompt_memo = PromptMemo(self.prompts)
        self.prompt_limits = prompt_limits or PromptLimits()
        self.preparer = RequestPreparer(model, self.prompts, self.prompt_memo, self.prompt_limits, self.metrics,
                                        cache_results=result_cache is not None)
        self.runner = MeshRunner(mesh, tokenizer, model, hash_block_size, prefix_cache_scope,
                                 self.preparer.mark_ending)
        self.running = RunningRequests()  # the callers' streams, which a stopping gateway ends (gateway.running)

    @property
    def mesh(self) -> MeshClient:
        """The mesh client (the runner's)."""
        return self.runner.mesh

    async def close(self) -> None:
        """Closes the mesh client's and the result store's connections."""
        await self.mesh.close()
        if self.result_cache is not None:
            await self.result_cache.close()

    def prepare(self, request: GenerationRequest, tenant: Tenant, received_at: float | None = None) -> Prepared:
        """Validates the request, claims its request id and starts its metrics. It then
        must be ``run`` (or ``end``-ed). ``received_at``: when the adapter received it
        (``time.monotonic()`` s; None: now). On an error its metrics end with it.

        Raises:
            AlreadyExists, ModelNotFound, InvalidArgument: as ``RequestPreparer.prepare``.
        """
        return self.preparer.prepare(request, tenant, received_at)

    async def prepare_async(self, request: GenerationRequest, tenant: Tenant,
                            received_at: float | None = None) -> Prepared:
        """``prepare`` with the tokenization and chat templating in a worker thread
        (``RequestPreparer.prepare_async``). Raises as ``prepare``."""
        return await self.preparer.prepare_async(request, tenant, received_at)

    async def prompt_ids(self, request: GenerationRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt ids ``prepare_async`` gives ``request``, without preparing it
        (``RequestPreparer.prompt_ids``: ``POST /tokenize``). Raises as that."""
        return await self.preparer.prompt_ids(request, add_special_tokens)

    def end(self, prepared: Prepared, error: BaseException | None = None) -> None:
        """Ends a prepared request: observes its metrics (``error``: what ended it) and
        frees its request id (``RequestPreparer.end``). ``run`` and ``generate`` call it;
        an adapter calls it for a prepared request it will not run. Only the first call counts."""
        self.preparer.end(prepared, error)

    async def generate(self, request: GenerationRequest, tenant: Tenant, options: SpanOptions = SpanOptions(),
                       received_at: float | None = None,
                       on_prepared: Callable[[Prepared], None] | None = None) -> AsyncIterator[Event]:
        """``prepare`` then ``run`` under one span, which also records a rejection.
        A caller that goes away (cancellation) is not an error of the span.
        ``on_prepared(prepared)``: called once the request is prepared, before its first
        event (an adapter learns its prompt ids: vLLM's ``return_token_ids``).

        Raises:
            MeshError: as ``prepare``, and the scheduler's or an executor's error.
        """
        s = self._start_span(ta.operation_name(request.input_kind), options)
        prepared, error = None, None
        try:
            prepared = await self.prepare_async(request, tenant, received_at)
            if on_prepared is not None:
                on_prepared(prepared)
            async with aclosing(self._events(prepared, s, None)) as events:
                async for event in events:
                    yield event
        except Exception as exc:
            record_error(s, exc)
            error = exc
            raise
        except BaseException as exc:  # the caller went away (CancelledError, GeneratorExit)
            error = exc
            raise
        finally:
            if prepared is not None:
                self.end(prepared, error)
            s.end()

    async def run(self, prepared: Prepared, options: SpanOptions = SpanOptions(),
                  on_assigned: OnAssigned | None = None, hold_refusals: bool = False) -> AsyncIterator[Event]:
        """Generates a prepared request, under its own span (a cancel is recorded on it).

        A deterministic request with the result cache on is answered from the cache
        when it holds the same request's output (no scheduler, no executor), else run
        and, when every choice completes, stored. ``on_assigned()`` is awaited once the
        scheduler has assigned an executor, before it runs. The request is ended however
        the run ends, except, with ``hold_refusals``, a refusal for now (``refused_for_now``):
        it keeps its request id and its metrics open, to be run again or ``end``-ed (a
        task waiting the refusal out is one request in the metrics).

        Raises:
            MeshError: the scheduler's or the executor's error (same code).
        """
        s = self._start_span(prepared.operation, options)
        error = None
        try:
            async with aclosing(self._events(prepared, s, on_assigned)) as events:
                async for event in events:
                    yield event
        except BaseException as exc:
            record_error(s, exc)
            error = exc
            raise
        finally:
            if not (hold_refusals and refused_for_now(error, prepared)):
                self.end(prepared, error)
            s.end()

    async def is_cached(self, prepared: Prepared) -> bool:
        """Whether the result cache holds this request's output now (a look, not a hit)."""
        return (prepared.cache_key is not None and self.results is not None
                and await self.results.store.peek(prepared.cache_key))

    def _start_span(self, operation: str, options: SpanOptions) -> trace.Span:
        """The request's span, named by the GenAI convention, child of ``options.parent``."""
        span = _tracer.start_span(ta.span_name(operation, self.model.model_id), context=options.parent,
                                  kind=options.kind,
                                  attributes={ta.OPERATION_NAME: operation, ta.REQUEST_MODEL: self.model.model_id,
                                              ta.REQUEST_STREAM: options.stream})
        if options.attributes:
            span.set_attributes(options.attributes)
        return span

    async def _events(self, p: Prepared, span: trace.Span, on_assigned: OnAssigned | None) -> AsyncIterator[Event]:
        """The request's events (``_outputs``); with ``include_stop_str_in_output``, what
        stopped a choice comes as one more ``Delta`` (no tokens) right before its result: the
        stop string, or the text of the stop token (one of ``stop_token_ids``; an EOS has
        none: ``gateway.choices.KeptStops``). Added here, after the result cache, whose
        entries hold the text without it."""
        kept = KeptStops(self.tokenizer, p.params.stop) if p.include_stop_str_in_output else None
        async with aclosing(self._outputs(p, span, on_assigned)) as events:
            async for event in events:
                if kept is not None:
                    stop, event = kept.take(event)
                    if stop:
                        yield Delta(event.index, stop, (), last=True)
                yield event

    async def _outputs(self, p: Prepared, span: trace.Span, on_assigned: OnAssigned | None) -> AsyncIterator[Event]:
        """The request's events: from the result cache, else from the mesh (then cached)."""
        span.set_attributes({ta.REQUEST_ID: p.request_id, ta.TENANT: p.tenant, ta.PRIORITY: p.priority,
                             ta.USAGE_INPUT_TOKENS: len(p.prompt_ids), **ta.sampling_attributes(p.params)})
        if p.cache_key is None:
            async with aclosing(self.runner.run(p, span, on_assigned)) as events:
                async for event in events:
                    yield event
            return
        async with self.results.flight(p.cache_key) as flight:  # coalesced with identical requests
            span.set_attribute(ta.RESULT_CACHE_HIT, flight.cached is not None)
            if flight.cached is not None:
                for event in self._replay(p, span, flight.cached):
                    yield event
                return
            collector = ChoiceCollector()
            async with aclosing(self.runner.run(p, span, on_assigned)) as events:
                async for event in events:
                    collector.feed(event)
                    yield event
            if collector.complete(p.params.n) and not self._cut_by_lease(p, collector.choices()):
                flight.value = tuple(collector.choices())

    def _cut_by_lease(self, p: Prepared, choices: list[CompletedChoice]) -> bool:
        """A choice ended "length" before its ``max_tokens`` and the context's end: its
        lease bounded it (``LeaseClaims.max_tokens``, its tenant's KV quota), an answer
        that a tenant of another quota sharing the cache scope must not get."""
        limit = min(p.params.max_tokens, self.model.max_model_len - len(p.prompt_ids))
        return any(c.result is not None and c.result.finish_reason == FinishReason.LENGTH and len(c.token_ids) < limit
                   for c in choices)

    def _replay(self, p: Prepared, span: trace.Span, cached: tuple[CompletedChoice, ...]):
        """A result-cache hit's events, observed as a request whose tokens all came at once."""
        num_tokens = sum(len(c.token_ids) for c in cached)
        p.metrics.first_token(time.monotonic())
        p.metrics.tokens(num_tokens)
        yield from replay(cached, p.request_id, p.timer.start)
        span.set_attributes({ta.USAGE_OUTPUT_TOKENS: num_tokens, ta.RESPONSE_ID: p.request_id,
                             ta.RESPONSE_MODEL: self.model.model_id,
                             ta.RESPONSE_FINISH_REASONS: finish_reasons([c.result for c in cached])})
