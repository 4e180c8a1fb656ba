"""Request preparation: a caller's request checked, tokenized and holding its request id.

``RequestPreparer`` turns what an adapter hands the core (``gateway.request.GenerationRequest``
and a ``Tenant``) into a ``Prepared`` request, ready to run (vLLM's input processing), and
ends it once it has run. ``GatewayCore.prepare``, ``prepare_async``, ``prompt_ids`` and
``end`` (``gateway.generation``) are these. A request is prepared in four steps:

1. its priority (in int32; the tenant's default, under the tenant's ceiling), its timer
   and its metrics (``gateway.metrics``);
2. the checks that need no tokenizer, cheap, on the event loop: the request id (the
   caller's or a new one), ``cache_salt``, the model, the prompt's size
   (``gateway.prompt_limits``);
3. the prompt's token ids: remembered (``gateway.prompt_memo``), else built
   (``gateway.prompt.PromptBuilder``; ``prepare_async``: in a worker thread);
4. the sampling parameters (``meshserve.sampling.validate``), the prompt against
   ``max_model_len``, the result-cache key of a deterministic request; then the
   request id is claimed.

Request ids in flight are kept per tenant (``meshserve.request_ids``): one tenant's id
never collides with, nor reveals, another's. ``prepare`` claims an id, ``end`` frees it.
A request whose id is held by one that is ending (``mark_ending``: releasing its lease;
its caller went away or got its last message) waits for that end, at most
``ENDING_WAIT_S``, instead of being refused: a retry under the same id right after a
cancel or a deadline is served (one under the id of a request still running after
``RUNNING_GRACE_S`` is refused).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway.choices import RequestTimer
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.prompt import PromptBuilder
from gateway.prompt_limits import PromptLimits
from gateway.prompt_memo import PromptMemo
from gateway.request import GenerationRequest, ModelInfo, Prepared
from gateway.result_cache import cache_key, is_deterministic
from gateway.tenants import Tenant
from meshserve import trace_attributes as ta
from meshserve.block_hash import check_cache_salt
from meshserve.errors import AlreadyExists, InvalidArgument
from meshserve.request_ids import check_request_id, scoped_request_id
from meshserve.sampling import INT32_MAX, INT32_MIN, validate

ENDING_WAIT_S = 10.0
"""Longest a request waits for an ending one under its id (its lease's Release: at most 5 s)."""
RUNNING_GRACE_S = 0.25
"""How long a request under the id of a running one waits for that one to begin ending."""


class RequestPreparer:
    """Prepares the requests for one model, and ends them.

    Args:
        model: the model served (its names, ``max_model_len`` and ``vocab_size``; its
            id and revision key the result cache).
        prompts: builds the prompt ids (over the model's tokenizer).
        prompt_memo: the ids of recent prompts (over ``prompts``).
        prompt_limits: size limits checked before tokenizing.
        metrics: the Prometheus metrics each request's observations start in.
        cache_results: the result cache is on: a deterministic request gets a ``cache_key``.
    """

    def __init__(self, model: ModelInfo, prompts: PromptBuilder, prompt_memo: PromptMemo,
                 prompt_limits: PromptLimits, metrics: GatewayMetrics, cache_results: bool):
        self.model = model
        self.prompts = prompts
        self.prompt_memo = prompt_memo
        self.prompt_limits = prompt_limits
        self.metrics = metrics
        self.cache_results = cache_results
        self._in_flight: set[str] = set()  # scoped request ids of unfinished requests
        self._ending: dict[str, asyncio.Event] = {}  # those releasing their lease: set when the id is free

    def prepare(self, request: GenerationRequest, tenant: Tenant, received_at: float | None = None) -> Prepared:
        """Validates the request, claims its request id and starts its metrics. It then
        must be ``run`` (or ``end``-ed). ``received_at``: when the adapter received it
        (``time.monotonic()`` s; None: now). On an error its metrics end with it.

        Raises:
            AlreadyExists: the request id is in use by an unfinished request.
            ModelNotFound: ``request.model`` is not one of the served names (``ModelInfo.names``).
            InvalidArgument: a bad parameter or prompt (the message names it).
        """
        timer, priority, metrics = self._start(request, tenant, received_at)
        try:
            request_id = self._check_before_tokenizing(request, tenant.name)
            return self._prepare(request, request_id, tenant, priority, metrics, timer,
                                 self.prompt_memo.lookup(request) or self.prompt_memo.build(request))
        except BaseException as exc:
            metrics.end(time.monotonic(), exc)
            raise

    async def prepare_async(self, request: GenerationRequest, tenant: Tenant,
                            received_at: float | None = None) -> Prepared:
        """``prepare`` with the tokenization and chat templating in a worker thread, so a
        huge prompt never stalls the event loop (other callers, health checks). The size
        limits are checked before, on the loop (cheap). Raises as ``prepare``."""
        timer, priority, metrics = self._start(request, tenant, received_at)
        try:
            if request.request_id:
                await self._wait_ending(scoped_request_id(tenant.name, request.request_id))
            request_id = self._check_before_tokenizing(request, tenant.name)
            return self._prepare(request, request_id, tenant, priority, metrics, timer,
                                 await self._build_prompt(request))
        except BaseException as exc:
            metrics.end(time.monotonic(), exc)
            raise

    async def prompt_ids(self, request: GenerationRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt ids ``prepare_async`` gives ``request`` (the same checks before
        tokenizing, the same prompt memo and builder, in a worker thread), without
        preparing it: no request id, no tenant, no metrics, and no check against
        ``max_model_len`` (``POST /tokenize`` reports the count beside it).
        ``add_special_tokens`` False: a raw ``prompt`` without what the tokenizer's
        post-processor adds (``PromptBuilder.tokenize``; not remembered); a chat's
        special tokens come from its template either way. An empty raw ``prompt`` is
        counted, not refused (vLLM's ``/tokenize``: ``[]``).

        Raises:
            ModelNotFound: ``request.model`` is not one of the served names.
            InvalidArgument: a prompt over a size limit, or as ``PromptBuilder.from_request``.
        """
        self._check_prompt(request)
        if request.prompt is not None and len(request.input_kinds) == 1 and not (add_special_tokens and request.prompt):
            return await asyncio.to_thread(self.prompts.tokenize, request.prompt, add_special_tokens)
        return await self._build_prompt(request)

    async def _build_prompt(self, request: GenerationRequest) -> list[int]:
        """The request's prompt ids: remembered (a repeated prompt: no thread, no tokenizer), else
        built in a worker thread. Raises ``InvalidArgument`` as ``PromptBuilder.from_request``."""
        prompt_ids = self.prompt_memo.lookup(request)
        if prompt_ids is None:
            prompt_ids = await asyncio.to_thread(self.prompt_memo.build, request)
        return prompt_ids

    async def _wait_ending(self, scoped_id: str) -> None:
        """Waits, at most ``ENDING_WAIT_S``, until the request ending under ``scoped_id``
        (if any) has ended. One still running is given ``RUNNING_GRACE_S`` to begin its
        end (a caller whose deadline passed retries before the gateway has seen it pass),
        then not waited for (``AlreadyExists`` follows)."""
        loop = asyncio.get_running_loop()
        grace_end = loop.time() + RUNNING_GRACE_S
        while scoped_id in self._in_flight and scoped_id not in self._ending and loop.time() < grace_end:
            await asyncio.sleep(0.01)
        ending = self._ending.get(scoped_id)
        if ending is not None:
            try:
                await asyncio.wait_for(ending.wait(), ENDING_WAIT_S)
            except TimeoutError:
                pass

    def _start(self, request: GenerationRequest, tenant: Tenant, received_at: float | None):
        """The request's timer, priority (the tenant's default, under its ceiling) and metrics."""
        if request.priority is not None and not INT32_MIN <= request.priority <= INT32_MAX:
            raise InvalidArgument(f"priority must be in [{INT32_MIN}, {INT32_MAX}], got {request.priority}")
        timer = RequestTimer(received_at)
        priority = request.priority if request.priority is not None else tenant.default_priority
        if tenant.max_priority is not None:
            priority = min(priority, tenant.max_priority)
        return timer, priority, self.metrics.start(tenant.name, priority, timer.start)

    def _check_before_tokenizing(self, request: GenerationRequest, tenant: str) -> str:
        """The request id (the caller's or a new one) after the checks that need no tokenizer.

        Raises:
            InvalidArgument: an id too long, a bad ``cache_salt``, a prompt over a size limit.
            AlreadyExists, ModelNotFound: as ``prepare``.
        """
        request_id = request.request_id or uuid.uuid4().hex
        check_request_id(request_id)
        check_cache_salt(request.cache_salt)
        if scoped_request_id(tenant, request_id) in self._in_flight:
            raise AlreadyExists(f"request_id {request_id!r} is already in use by an unfinished request")
        self._check_prompt(request)
        return request_id

    def _check_prompt(self, request: GenerationRequest) -> None:
        """The model and the prompt's size, before anything is tokenized (cheap: on the loop).

        Raises:
            ModelNotFound: ``request.model`` is not one of the served names.
            InvalidArgument: a prompt over a size limit (``gateway.prompt_limits``).
        """
        if request.model is not None:
            self.model.check_served(request.model)
        self.prompt_limits.check(request, self.model.max_model_len)

    def _prepare(self, request: GenerationRequest, request_id: str, tenant: Tenant, priority: int,
                 metrics: RequestMetrics, timer: RequestTimer, prompt_ids: list[int]) -> Prepared:
        if scoped_request_id(tenant.name, request_id) in self._in_flight:  # claimed while it was tokenized
            raise AlreadyExists(f"request_id {request_id!r} is already in use by an unfinished request")
        params = validate(request.sampling, max_model_len=self.model.max_model_len, vocab_size=self.model.vocab_size)
        if len(prompt_ids) + 1 > self.model.max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.model.max_model_len} "
                "(prompt + at least 1 output token)"
            )
        metrics.num_prompt_tokens = len(prompt_ids)
        key = None
        salt = request.cache_salt or ""
        if self.cache_results and is_deterministic(params):
            key = cache_key(self.model.model_id, self.model.revision, prompt_ids, params, scope=tenant.cache_scope,
                            cache_salt=salt)
        self._in_flight.add(scoped_request_id(tenant.name, request_id))
        return Prepared(request_id, tenant.name, ta.operation_name(request.input_kind), prompt_ids, params, priority,
                        metrics, timer, key, include_stop_str_in_output=request.include_stop_str_in_output,
                        cache_salt=salt)

    def end(self, prepared: Prepared, error: BaseException | None = None) -> None:
        """Ends a prepared request: observes its metrics (``error``: what ended it) and
        frees its request id. ``GatewayCore.run`` and ``generate`` call it; an adapter
        calls it for a prepared request it will not run. Only the first call counts."""
        if prepared.ended:
            return
        prepared.ended = True
        prepared.metrics.end(time.monotonic(), error)
        scoped_id = scoped_request_id(prepared.tenant, prepared.request_id)
        self._in_flight.discard(scoped_id)
        ending = self._ending.pop(scoped_id, None)
        if ending is not None:
            ending.set()

    def mark_ending(self, prepared: Prepared) -> None:
        """Marks a prepared request as ending (releasing its lease) until ``end``: a
        request under its id waits for that end instead of being refused."""
        self._ending.setdefault(scoped_request_id(prepared.tenant, prepared.request_id), asyncio.Event())
