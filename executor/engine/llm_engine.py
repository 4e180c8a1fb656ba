"""LLMEngine: the synchronous engine core; one ``step()`` is one batch.

The step loop is three calls with plain dataclasses between them (vLLM v1)::

    SchedulerOutput   = batch_scheduler.schedule()
    ModelRunnerOutput = model_runner.execute_model(SchedulerOutput)
    [RequestOutput]   = batch_scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput)

Not thread-safe: ``AsyncEngine`` drives it from one thread. ``check_request`` is
the exception: it reads only immutable limits, so any thread may call it.

With a ``KVConnector`` (``set_kv_connector``), a step starts by taking finished
kvstore fetches and giving up late ones, and ends by publishing the full blocks
it cached (see ``executor.engine.kv_connector``).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from executor.attention.backend import resolve_backend_name
from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import EngineConfig
from executor.worker.kv_cache import bytes_per_block, num_blocks_for_budget
from executor.engine.kv_cache_manager import KVCacheManager, cdiv
from executor.engine.kv_connector import KVConnector
from executor.worker.model_runner import ModelRunner
from executor.engine.outputs import EngineStats, RequestOutput
from executor.engine.request import ExternalKV, Request
from executor.model_loader import load_model
from meshserve.block_hash import BlockHash, KVLayout, KVStoreFingerprint, ModelFingerprint
from meshserve.errors import InvalidArgument
from meshserve.model_files import resolve_model
from meshserve.sampling import SamplingParams, validate

log = logging.getLogger(__name__)


class LLMEngine:
    """One model replica with its paged KV cache and continuous batch.

    Args:
        config: engine configuration; the model is resolved with
            ``meshserve.model_files.resolve_model(config.model)``.

    Raises:
        FileNotFoundError: the model cannot be resolved.
        ValueError: bad configuration (dtype, max_model_len, cache budget smaller
            than one block, unsupported architecture).
    """

    def __init__(self, config: EngineConfig):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        files = resolve_model(config.model)
        self.model_id, self.revision = files.model_id, files.revision
        loaded = load_model(files.path, dtype=config.dtype, max_model_len=config.max_model_len,
                            attention_backend=resolve_backend_name(config.attention_backend, config.device),
                            device=config.device)
        self.dtype = loaded.dtype
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.block_size = config.cache.block_size
        layer = loaded.model.attention_layers()[0]
        block_bytes = bytes_per_block(len(loaded.model.attention_layers()), self.block_size, layer.num_kv_heads,
                                      layer.head_dim, loaded.dtype)
        self.num_blocks = config.cache.num_blocks or num_blocks_for_budget(config.cache.kv_cache_memory_bytes,
                                                                           block_bytes)
        self.fingerprint = ModelFingerprint(self.model_id, self.revision)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size, config.cache.enable_prefix_caching,
                                               self.fingerprint, config.cache.enable_kv_events)
        self.batch_scheduler = BatchScheduler(config.batch, self.kv_cache_manager, self.eos_token_ids)
        self.model_runner = ModelRunner(loaded, self.num_blocks, self.block_size, config.seed, config.device)
        self.kv_layout = KVLayout(self.block_size, len(loaded.model.attention_layers()), layer.num_kv_heads,
                                  layer.head_dim, str(loaded.dtype).removeprefix("torch."))
        self.kv_connector: KVConnector | None = None
        self.kvstore_queried_tokens = 0
        self.num_steps = 0
        self.forward_seconds = 0.0  # wall seconds spent in execute_model (busy fraction, MFU)
        self.num_forward_tokens = 0  # tokens run through the model (prefill chunks + decodes)
        self.num_params = sum(p.numel() for p in loaded.model.parameters())  # for the MFU estimate
        self.last_step_was_empty = False
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        log.info("engine ready: %s, %d blocks of %d tokens (%.1f MiB), max_model_len %d", self.model_id,
                 self.num_blocks, self.block_size, self.num_blocks * block_bytes / 2**20, self.max_model_len)

    # -- requests -------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Validates a request against the engine's limits; returns normalised params.

        Thread-safe (reads only immutable limits). Does not check the request id.

        Raises:
            InvalidArgument: empty prompt, an id outside the vocabulary, a prompt that
                leaves no room for one generated token within ``max_model_len``, a
                prompt needing more blocks than the whole cache, a prompt longer than
                ``max_num_batched_tokens`` with chunked prefill off, or invalid params.
        """
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
        return validate(params, max_model_len=self.max_model_len, vocab_size=self.vocab_size)

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
        self.batch_scheduler.newly_cached_blocks = [] if connector is not None else None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, trace_context: object = None) -> None:
        """Queues a request; it joins the running batch at a following step (after its
        kvstore fetch, when a connector is set and its prefix is not all cached here).

        Args:
            trace_context: OpenTelemetry context, parent of the kvstore spans.

        Raises:
            InvalidArgument: see ``check_request``; also an empty or duplicate request id.
        """
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if request_id in self.batch_scheduler.requests:
            raise InvalidArgument(f"request_id {request_id!r} is already in use by an unfinished request")
        params = self.check_request(prompt_token_ids, params)
        max_len = min(self.max_model_len, self.num_blocks * self.block_size)
        request = Request(request_id, list(prompt_token_ids), params, priority, next(self._arrivals), max_len)
        request.trace_context = trace_context
        if not self._start_fetch(request):
            self.batch_scheduler.add_request(request)

    def _start_fetch(self, request: Request) -> bool:
        """Starts fetching the request's full prompt blocks after its local prefix hit
        (up to the block before its last token); False when there is nothing to fetch."""
        conn = self.kv_connector
        if conn is None or not self.kv_cache_manager.enable_caching or \
                request.sampling_params.prompt_logprobs is not None:
            return False
        hits, _ = self.kv_cache_manager.get_computed_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if len(hits) >= max_blocks:
            return False
        hashes = self.kv_cache_manager.block_hashes(request)[len(hits):max_blocks]
        self.batch_scheduler.add_fetching(request, time.monotonic() + conn.fetch_timeout_s)
        conn.start_fetch(request.request_id, len(hits), hashes, request.trace_context)
        self.kvstore_queried_tokens += len(hashes) * self.block_size
        return True

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request and frees its KV blocks at once (a kvstore fetch in flight
        is cancelled, releasing its leases).

        Returns:
            False when the id is unknown or the request already finished.
        """
        if self.kv_connector is not None:
            self.kv_connector.cancel(request_id)
        return self.batch_scheduler.abort_request(request_id)

    # -- the step loop --------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one iteration of the batch.

        Returns:
            One output per request that got a token (finished ones included); empty
            when nothing is runnable.
        """
        if self.kv_connector is not None:
            self._take_fetches()
        scheduler_output = self.batch_scheduler.schedule()
        self.last_step_was_empty = scheduler_output.is_empty
        if scheduler_output.is_empty:
            self.model_runner.release(scheduler_output.finished_request_ids)
            return []
        started = time.perf_counter()
        runner_output = self.model_runner.execute_model(scheduler_output)
        self.forward_seconds += time.perf_counter() - started
        self.num_forward_tokens += scheduler_output.num_scheduled_tokens
        self.num_steps += 1
        outputs = self.batch_scheduler.update_from_output(scheduler_output, runner_output)
        if self.kv_connector is not None:
            self._publish_cached_blocks()
        return outputs

    def _take_fetches(self) -> None:
        """Moves fetched requests to waiting with their payloads; gives up fetches past
        their deadline (they recompute). Late completions are ignored."""
        conn = self.kv_connector
        for result in conn.poll():
            external = ExternalKV(result.start_block, result.payloads) if result.payloads else None
            self.batch_scheduler.finish_fetch(result.request_id, external)
        for request_id in self.batch_scheduler.expired_fetches(time.monotonic()):
            conn.cancel(request_id)
            conn.note_fetch_given_up()
            self.batch_scheduler.finish_fetch(request_id, None)

    def _publish_cached_blocks(self) -> None:
        """Copies the full blocks cached by this step out of the paged cache (one
        gather) and hands them to the connector, per request (for its trace)."""
        cached, self.batch_scheduler.newly_cached_blocks = self.batch_scheduler.newly_cached_blocks, []
        keyed = [(request, block_id, h) for request, block_id, h in cached if not self.kv_connector.is_known(h)]
        if not keyed:
            return
        kv = self.model_runner.read_blocks([block_id for _, block_id, _ in keyed])
        by_request: dict[str, tuple[object, list]] = {}
        for i, (request, _, block_hash) in enumerate(keyed):
            by_request.setdefault(request.request_id, (request.trace_context, []))[1].append((block_hash, kv[i]))
        for trace_context, blocks in by_request.values():
            self.kv_connector.publish(blocks, trace_context)

    def wake_deadline(self) -> float | None:
        """Monotonic seconds at which an idle engine must step again: a batching hold's
        end or the earliest kvstore fetch deadline (None: only new work wakes it)."""
        deadlines = [r.fetch_deadline for r in self.batch_scheduler.fetching.values()]
        if self.batch_scheduler.hold_deadline is not None:
            deadlines.append(self.batch_scheduler.hold_deadline)
        return min(deadlines) if deadlines else None

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
            kvstore_queried_tokens=self.kvstore_queried_tokens,
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
