"""LLMEngine: the synchronous engine core; one ``step()`` is one batch.

The step loop is three calls with plain dataclasses between them (vLLM v1)::

    SchedulerOutput   = batch_scheduler.schedule()
    ModelRunnerOutput = worker_group.execute_model(SchedulerOutput)
    [RequestOutput]   = batch_scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput)

The engine never touches the model: it drives a ``WorkerGroup``
(``executor.engine.worker_group``; by default one in-process worker) through that
one call, whose inputs are plain picklable data.

Not thread-safe: ``AsyncEngine`` drives it from one thread. ``check_request`` is
the exception: it reads only immutable limits, so any thread may call it.

With a ``KVConnector`` (``set_kv_connector``), its scheduler half decides what
each step fetches, loads and publishes (see ``executor.engine.kv_connector``).
"""

from __future__ import annotations

import itertools
import logging
import time

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import EngineConfig
from executor.engine.kv_cache_manager import KVCacheManager, cdiv, num_blocks_for_budget
from executor.engine.kv_connector import KVConnector, KVConnectorScheduler
from executor.engine.outputs import EngineStats, RequestOutput
from executor.engine.request import CheckedRequest, Request
from executor.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from executor.engine.structured_output import GrammarCompiler, GrammarState
from executor.engine.worker_group import WorkerGroup
from executor.worker.group import make_worker_group
from meshserve.block_hash import KVStoreFingerprint, ModelFingerprint
from meshserve.errors import InvalidArgument
from meshserve.model_files import resolve_model
from meshserve.sampling import SamplingParams, validate

log = logging.getLogger(__name__)


class LLMEngine:
    """One model replica with its paged KV cache and continuous batch.

    Args:
        config: engine configuration; the model is resolved with
            ``meshserve.model_files.resolve_model(config.model)``.
        worker_group: what runs the model (default: ``executor.worker.group.make_worker_group(config)``:
            one in-process worker, or the ranks of ``config.parallel``); the
            engine allocates its cache and shuts it down.

    Raises:
        FileNotFoundError: the model cannot be resolved.
        ValueError: bad configuration (dtype, max_model_len, cache budget smaller
            than one block, unsupported architecture).
    """

    def __init__(self, config: EngineConfig, worker_group: WorkerGroup | None = None):
        if worker_group is None:
            worker_group = make_worker_group(config)
        self.config = config
        self.worker_group = worker_group
        spec = worker_group.spec
        self.model_id, self.revision = spec.model_id, spec.revision
        self.dtype = spec.dtype  # the model's and KV cache's dtype name ("float32", ...)
        self.max_model_len = spec.max_model_len
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = spec.eos_token_ids
        self.num_params = spec.num_params  # for the MFU estimate
        self.block_size = config.cache.block_size
        self.kv_layout = spec.kv_layout(self.block_size)
        self.num_blocks = config.cache.num_blocks or num_blocks_for_budget(config.cache.kv_cache_memory_bytes,
                                                                           self.kv_layout.block_bytes)
        worker_group.initialize_cache(self.num_blocks, self.block_size)
        self.fingerprint = ModelFingerprint(self.model_id, self.revision)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size, config.cache.enable_prefix_caching,
                                               self.fingerprint, config.cache.enable_kv_events)
        self.batch_scheduler = BatchScheduler(config.batch, self.kv_cache_manager, self.eos_token_ids)
        self.grammars = GrammarCompiler(lambda: resolve_model(config.model, config.revision).path, self.vocab_size,
                                        self.eos_token_ids)
        self.kv_connector: KVConnector | None = None
        self.num_steps = 0
        self.forward_seconds = 0.0  # wall seconds spent in execute_model (busy fraction, MFU)
        self.num_forward_tokens = 0  # tokens run through the model (prefill chunks + decodes)
        self.last_step_was_empty = False
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        if config.warm_up:
            log.info("warm-up: %d prompt tokens through the model in %.2f s", *self.warm_up())
        log.info("engine ready: %s, %d blocks of %d tokens (%.1f MiB), max_model_len %d", self.model_id,
                 self.num_blocks, self.block_size, self.num_blocks * self.kv_layout.block_bytes / 2**20,
                 self.max_model_len)

    WARM_UP_PROMPT_LEN = 128
    """Tokens of each prompt ``warm_up`` runs: short prompts, whose tokens take the CPU
    attention kernel's rows and the one-call decoder stack, as a burst of requests does."""

    def warm_up(self) -> tuple[int, float]:
        """Runs one full step of prompt tokens through the workers before any request, as
        vLLM's start-up dummy run does: ``min(max_num_batched_tokens, the cache's tokens)``
        tokens as prompts of up to ``WARM_UP_PROMPT_LEN`` (at most ``max_num_seqs`` of them,
        ``max_model_len - 1`` each), each sampled once, in the cache's first blocks; then the
        workers drop them. Nothing of it stays: the scheduler, the block pool, the prefix
        cache and the stats never see it (its blocks were not taken from the pool, and a
        request's blocks are written before they are read). Without it the first steps of
        that size after start-up took 1.2x as long (a 2,048-token prefill step of the default
        model in bfloat16 on one core, paging in the memory the step's activations take).

        Returns:
            ``(tokens, seconds)``: the tokens run and the wall seconds it took.

        Raises:
            Whatever the workers' ``execute_model`` raises.
        """
        batch = self.config.batch
        budget = min(batch.max_num_batched_tokens, self.num_blocks * self.block_size)
        length = min(max(self.WARM_UP_PROMPT_LEN, cdiv(budget, batch.max_num_seqs)), self.max_model_len - 1)
        scheduled, params, total, first_block = [], SamplingParams(max_tokens=1, temperature=0.0), 0, 0
        while length > 0 and total < budget and len(scheduled) < batch.max_num_seqs:
            tokens = [(total + i) % self.vocab_size for i in range(min(length, budget - total))]
            blocks = list(range(first_block, first_block + cdiv(len(tokens), self.block_size)))
            if blocks[-1] >= self.num_blocks:
                break
            scheduled.append(ScheduledRequest(f"\0warm-up-{total}", tokens, 0, blocks, params, True, tokens,
                                              len(tokens)))
            total, first_block = total + len(tokens), first_block + len(blocks)
        if not scheduled:
            return 0, 0.0
        started = time.perf_counter()
        self.worker_group.execute_model(SchedulerOutput(scheduled, total))
        self.worker_group.execute_model(SchedulerOutput([], 0, finished_request_ids={r.request_id for r in scheduled}))
        return total, time.perf_counter() - started

    # -- requests -------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """Checks a request against the engine's limits, once where it enters the engine
        (the executor's servicer, ``AsyncEngine.generate``, ``add_request``); returns it
        with normalised params for ``add_checked``, which does not check again.

        Thread-safe (reads only immutable limits; a structured output's grammar is compiled
        by ``grammars``, which is thread-safe: milliseconds for common schemas). Does not
        check the request id.

        Raises:
            InvalidArgument: invalid params (checked first), an empty prompt, an id
                outside the vocabulary, a prompt that leaves no room for one generated
                token within ``max_model_len``, a prompt needing more blocks than the
                whole cache, or a prompt longer than ``max_num_batched_tokens`` with
                chunked prefill off; a structured output xgrammar cannot compile, or a model
                without a tokenizer.
        """
        params = validate(params, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidArgument("prompt_token_ids must not be empty")
        low, high = min(prompt_token_ids), max(prompt_token_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InvalidArgument(f"prompt_token_ids entry {bad} is outside the vocabulary [0, {self.vocab_size})")
        if n + 1 > self.max_model_len:
            raise InvalidArgument(f"prompt has {n} tokens; prompt + 1 generated token exceeds max_model_len "
                                  f"{self.max_model_len}")
        if cdiv(n, self.block_size) > self.num_blocks:
            raise InvalidArgument(f"prompt has {n} tokens and needs {cdiv(n, self.block_size)} KV blocks of "
                                  f"{self.block_size} tokens; the whole KV cache has {self.num_blocks} blocks")
        batch = self.config.batch
        if not batch.enable_chunked_prefill and n > batch.max_num_batched_tokens:
            raise InvalidArgument(f"prompt has {n} tokens, more than max_num_batched_tokens "
                                  f"{batch.max_num_batched_tokens} (chunked prefill is off)")
        grammar = self.grammars.compile(params.structured_output) if params.structured_output is not None else None
        return CheckedRequest(tuple(prompt_token_ids), params, grammar=grammar)

    @property
    def kv_store_fingerprint(self) -> KVStoreFingerprint:
        """The namespace of this engine's blocks in a kvstore (model identity + layout)."""
        return KVStoreFingerprint(self.fingerprint, self.kv_layout)

    def set_kv_connector(self, connector: KVConnector | None) -> None:
        """Shares prefix blocks through ``connector`` (None: stop sharing). Call before
        the engine thread starts.

        Raises:
            ValueError: the connector's fingerprint is not this engine's.
        """
        if connector is not None and connector.fingerprint != self.kv_store_fingerprint:
            raise ValueError(f"kv connector fingerprint {connector.fingerprint} is not the engine's "
                             f"{self.kv_store_fingerprint}")
        self.kv_connector = connector
        self.batch_scheduler.set_kv_connector(
            KVConnectorScheduler(connector, self.kv_cache_manager) if connector is not None else None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, trace_context: object = None) -> None:
        """Checks a request (``check_request``) and queues it (``add_checked``).

        Raises:
            InvalidArgument: an empty or duplicate request id (checked first); see
                ``check_request``.
        """
        self._check_request_id(request_id)
        self._queue(request_id, self.check_request(prompt_token_ids, params), priority, trace_context)

    def add_checked(self, request_id: str, request: CheckedRequest, priority: int = 0,
                    trace_context: object = None) -> None:
        """Queues a request ``check_request`` accepted (not checked again); it joins the
        running batch at a following step (after its kvstore fetch, when a connector is
        set and its prefix is not all cached here: ``BatchScheduler.add_request``).

        Args:
            trace_context: OpenTelemetry context, parent of the kvstore spans.

        Raises:
            InvalidArgument: an empty or duplicate request id.
        """
        self._check_request_id(request_id)
        self._queue(request_id, request, priority, trace_context)

    def _check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if request_id in self.batch_scheduler.requests:
            raise InvalidArgument(f"request_id {request_id!r} is already in use by an unfinished request")

    def _queue(self, request_id: str, checked: CheckedRequest, priority: int, trace_context: object) -> None:
        max_len = min(self.max_model_len, self.num_blocks * self.block_size)
        request = Request(request_id, list(checked.prompt_token_ids), checked.sampling_params, priority,
                          next(self._arrivals), max_len)
        request.trace_context = trace_context
        request.cache_salt = checked.cache_salt
        if checked.grammar is not None:
            request.grammar = GrammarState(checked.grammar)
        self.batch_scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request and frees its KV blocks at once (a kvstore fetch in flight
        is cancelled, releasing its leases).

        Returns:
            False when the id is unknown or the request already finished.
        """
        return self.batch_scheduler.abort_request(request_id)

    # -- the step loop --------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one iteration of the batch.

        Returns:
            One output per request that got a token (finished ones included); empty
            when nothing is runnable.
        """
        scheduler_output = self.batch_scheduler.schedule()
        self.last_step_was_empty = scheduler_output.is_empty
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:  # the workers drop those requests' state
                self.worker_group.execute_model(scheduler_output)
            return []
        started = time.perf_counter()
        runner_output = self.worker_group.execute_model(scheduler_output)
        self.forward_seconds += time.perf_counter() - started
        self.num_forward_tokens += scheduler_output.num_scheduled_tokens
        self.num_steps += 1
        return self.batch_scheduler.update_from_output(scheduler_output, runner_output)

    def wake_deadline(self) -> float | None:
        """Monotonic seconds at which an idle engine must step again: a batching hold's
        end or the earliest kvstore fetch deadline (None: only new work wakes it)."""
        return self.batch_scheduler.wake_deadline()

    def has_unfinished_requests(self) -> bool:
        return self.batch_scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        s = self.batch_scheduler
        return EngineStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_steps=self.num_steps,
            num_joined_running_batch=s.num_joined_running_batch,
            num_finished=s.num_finished,
            num_aborted=s.num_aborted,
            num_preemptions=s.num_preemptions,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            kv_cache_utilization=self.kv_cache_manager.utilization(
                {r.request_id: r.num_computed_tokens for r in s.running}),
            num_cached_free_blocks=self.kv_cache_manager.block_pool.num_evictable_blocks,
            num_prompt_tokens=s.num_prompt_tokens,
            num_generation_tokens=s.num_generation_tokens,
            num_blocks_by_request=tuple(sorted((rid, len(blocks))
                                               for rid, blocks in self.kv_cache_manager.req_to_blocks.items()
                                               if blocks)),
            kvstore_hit_tokens=s.kvstore_hit_tokens,
            kvstore_queried_tokens=s.kvstore_queried_tokens,
            kvstore=self.kv_connector.stats() if self.kv_connector is not None else None,
            forward_seconds=self.forward_seconds,
            num_forward_tokens=self.num_forward_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Drops every evictable cached block; False while cached blocks are in use."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def take_kv_events(self) -> list:
        """Prefix-cache stored/removed events since the last call (needs
        ``CacheConfig.enable_kv_events``)."""
        return self.kv_cache_manager.block_pool.take_events()

    def check_integrity(self) -> None:
        """Asserts the KV cache invariants (free + evictable + referenced == num_blocks;
        each block's reference count == requests holding it). Cheap; run it when idle
        and in tests.

        Raises:
            AssertionError: inconsistent state (a bug).
        """
        self.kv_cache_manager.check_integrity()
        held = set(self.kv_cache_manager.req_to_blocks)
        assert held <= set(self.batch_scheduler.requests), "blocks held by a request the scheduler forgot"

    def shutdown(self) -> None:
        """Aborts every request and shuts the worker group down; the engine is unusable after."""
        for request_id in list(self.batch_scheduler.requests):
            self.abort_request(request_id)
        self.worker_group.shutdown()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline generation: adds every prompt, steps until all finish.

        Returns:
            The generated token ids of each prompt, in order.

        Raises:
            InvalidArgument: a prompt or its params are invalid (nothing is left queued).
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgument(f"got {len(params_list)} params for {len(prompts)} prompts")
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        results: dict[str, list[int]] = {i: [] for i in ids}
        try:
            for request_id, prompt, p in zip(ids, prompts, params_list):
                self.add_request(request_id, prompt, p)
            pending = set(ids)
            while pending:
                if self.last_step_was_empty and self.batch_scheduler.hold_deadline is not None:
                    time.sleep(max(0.0, self.batch_scheduler.hold_deadline - time.monotonic()))
                elif self.last_step_was_empty and self.batch_scheduler.fetching:
                    time.sleep(0.0005)  # kvstore fetches in flight and nothing else to run
                for out in self.step():
                    if out.request_id in results:
                        results[out.request_id].extend(out.new_token_ids)
                        if out.finished:
                            pending.discard(out.request_id)
        finally:
            for request_id in ids:
                self.abort_request(request_id)  # no-op for finished ones
        return [results[i] for i in ids]
