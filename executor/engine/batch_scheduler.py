"""BatchScheduler: iteration-level continuous batching over a token budget.

(Named so it is not confused with the ``scheduler/`` service, which places
requests on executors.) Orca's iteration-level scheduling (Yu et al., OSDI '22)
with vLLM v1's rule "no prefill or decode phases, only a token budget": each
step gives every scheduled request a share of ``max_num_batched_tokens``:

1. running decodes, one token each (keeps inter-token latency flat);
2. running requests still in their prompt (chunked prefill), a chunk each;
3. waiting requests in order (higher priority first, then the fewest prompt tokens
   with ``prefill_order`` "shortest", the default, then earlier arrival), a first
   chunk each, while the budget, ``max_num_seqs`` and free blocks allow.

With short prefills first on (the default), 2 and 3 run twice: first for the
prefills with few tokens left, then for the rest (see below).

A prefill chunk may be capped (``long_prefill_token_threshold``), and new
prefills may wait to be batched with later arrivals (``max_batch_wait_ms``):
``executor.engine.step_budget`` holds the step's budget and these rules.

Short prefills first (``short_prefill_tokens`` > 0): a step takes its prefills
in two passes, the short ones first, and a longer one may sit out a few steps for
them (``executor.engine.prefill_order``).

Requests join and leave the batch every step. When a running request needs a
block and none is free, the scheduler preempts by recompute (vLLM, Kwon et al.,
SOSP '23): the victim is the running request with the lowest priority, then the
latest arrival; its blocks are freed and it goes back to waiting with
``num_computed_tokens = 0``. The request being scheduled is never preempted for
a lower one, and one request alone always fits (``Request.max_len`` is capped at
the cache's capacity), so the scheduler cannot deadlock. No waiting request is
admitted in a step whose running requests had to preempt.

Priority: a waiting request that does not fit (no free ``max_num_seqs`` slot or
too few blocks) preempts the lowest running request if, and only if, that one's
priority is strictly lower; equal priorities never preempt each other.

Prefix caching: a request scheduled from waiting (new or preempted) first takes
the longest cached prefix of its tokens (``KVCacheManager.get_computed_blocks``)
and starts with ``num_computed_tokens`` at its end; after each step the
request's newly computed full blocks are registered in the cache. A preempted
request usually finds its own blocks again, so recompute is often cheap. A
waiting request whose next uncached block another running request is computing
right now waits for it instead of computing it twice (in-flight prefix sharing,
as SGLang's radix cache does for concurrent requests); it waits before it would
take a slot, so it preempts nobody for a step it does not run.

KV from the kvstore (vLLM's KV connector, WAITING_FOR_REMOTE_KVS): with a
connector's scheduler half set (``set_kv_connector``,
``executor.engine.kv_connector.KVConnectorScheduler``), a new request whose
prefix is not all cached here waits in ``fetching`` (status
``WAITING_FOR_REMOTE_KVS``) while the half fetches its blocks and other requests
run; a step moves ended fetches to ``waiting``. When such a request is
scheduled, the fetched blocks that extend its local prefix hit get newly
allocated blocks, listed in ``SchedulerOutput.kv_loads`` for the worker to copy
in, and count as computed: the request skips their prefill. The full blocks a
step computes are listed in ``SchedulerOutput.kv_saves`` and published after it.
The half owns the fetch state; the scheduler only calls it.

The scheduler owns request status and ``num_computed_tokens``; it advances them
only in ``update_from_output``.
"""

from __future__ import annotations

import bisect
import logging
import time

from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.kv_connector import KVConnectorScheduler
from executor.engine.outputs import RequestOutput
from executor.engine.prefill_order import (SHORTEST_FIRST_WINDOW, Admit, count_passed_by_later, count_sit_outs,
                                           insert_preempted, shorts_only, shortest_first, the_rest)
from executor.engine.request import Request, RequestStatus
from executor.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from executor.engine.step_budget import StepState, batching_hold_deadline, cap_prefill, may_chunk
from executor.engine.stop import check_stop

log = logging.getLogger(__name__)


class BatchScheduler:
    """Decides, each step, which requests run and how many tokens each.

    Args:
        config: budget and limits.
        kv_cache_manager: the requests' KV blocks.
        eos_token_ids: ids that stop a request unless ``ignore_eos``.
    """

    def __init__(self, config: BatchSchedulerConfig, kv_cache_manager: KVCacheManager,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.kv = kv_cache_manager
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []   # sorted by Request.sort_key
        self.running: list[Request] = []   # sorted by Request.sort_key
        self.fetching: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, by request id
        self.connector: KVConnectorScheduler | None = None
        self.kvstore_hit_tokens = 0
        self.kvstore_queried_tokens = 0
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_deferred_for_prefix = 0  # times a waiting request waited for a block being computed
        self.num_joined_running_batch = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.hold_deadline: float | None = None  # monotonic time a held prefill is released
        self.clock = time.monotonic  # arrival times and deadlines (seconds); tests set a fake one

    # -- requests in and out --------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a validated request (the engine checks ids, lengths and params). With
        a connector it may wait in ``fetching`` while its prefix blocks are fetched."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        request.arrival_time = self.clock()
        num_fetched_blocks = self.connector.start_fetch(request, request.arrival_time) if self.connector else 0
        if num_fetched_blocks:
            self.kvstore_queried_tokens += num_fetched_blocks * self.kv.block_size
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.fetching[request.request_id] = request
        else:
            bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def set_kv_connector(self, connector: KVConnectorScheduler | None) -> None:
        """Shares prefix KV through ``connector``'s scheduler half (None: stop sharing).
        Requests still fetching through the previous one give up and recompute."""
        for request_id in list(self.fetching):
            self.connector.request_finished(request_id)
            self._end_fetch(request_id)
        self.connector = connector

    def _take_fetches(self) -> None:
        """Moves requests whose fetch ended (or was given up at its deadline) to waiting."""
        for request_id in self.connector.finished_fetches(self.clock()):
            self._end_fetch(request_id)

    def _end_fetch(self, request_id: str) -> None:
        request = self.fetching.pop(request_id, None)
        if request is not None:
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def wake_deadline(self) -> float | None:
        """When an idle engine must step again (``clock`` seconds): a batching hold's
        end or the earliest fetch deadline (None: only new work wakes it)."""
        deadlines = [self.hold_deadline, self.connector.next_deadline() if self.connector else None]
        return min((d for d in deadlines if d is not None), default=None)

    def abort_request(self, request_id: str) -> bool:
        """Finishes the request as aborted and frees its blocks now.

        Returns:
            False when the id is unknown or already finished.
        """
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.fetching.pop(request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self.num_aborted += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- schedule -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's batch and allocates its KV slots (see the module doc)."""
        if self.connector is not None:
            self._take_fetches()
        state = StepState(self.config.max_num_batched_tokens, {}, [])
        if len(self.running) + len(self.waiting) > 1:  # a lone request has nobody to keep waiting
            state.prefill_cap = self.config.long_prefill_token_threshold
        self.hold_deadline = None
        had_running = bool(self.running)
        shortest = self.config.prefill_order == "shortest" and len(self.waiting) > 1
        waiting = self.waiting[:SHORTEST_FIRST_WINDOW] if shortest else []
        self._schedule_running(state, decodes=True)
        limit = self.config.short_prefill_tokens
        charged: set[str] = set()
        if limit:
            before = set(state.scheduled)
            passed: list[Request] = []
            self._schedule_prefills(state, had_running, shorts_only(limit, passed))
            short_priority = max((self.requests[rid].priority for rid in state.scheduled if rid not in before),
                                 default=None)
            self._schedule_prefills(state, had_running, the_rest(limit, short_priority, passed))
            charged = count_sit_outs(passed, state.scheduled, short_priority)
        else:
            self._schedule_prefills(state, had_running, None)
        if waiting:
            count_passed_by_later(waiting, state.scheduled, charged)
        self.num_deferred_for_prefix += len(state.deferred_for_prefix)
        batch = [(self.requests[rid], n) for rid, n in state.scheduled.items()]
        kv_loads, kv_saves = self.connector.build_connector_meta(batch) if self.connector else ([], [])
        scheduled = [self._scheduled_request(request, n) for request, n in batch]
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled, sum(state.scheduled.values()), state.preempted, finished, kv_loads,
                               kv_saves)

    def _schedule_prefills(self, state: StepState, had_running: bool, admit: Admit | None) -> None:
        """Running prompts' next chunks, then waiting requests, as ``admit`` (the request,
        its tokens left to compute) says: True takes it, False passes it over, None (waiting
        requests) ends the pass there; ``admit`` None takes all."""
        self._schedule_running(state, decodes=False, admit=admit)
        if not state.preempted:
            self._schedule_waiting(state, had_running, admit)

    def _schedule_running(self, state: StepState, decodes: bool, admit: Admit | None = None) -> None:
        for request in list(self.running):
            if state.budget == 0:
                return
            if request.status != RequestStatus.RUNNING or request.request_id in state.scheduled:
                continue
            if (request.num_uncomputed_tokens == 1) != decodes:
                continue
            if admit is not None and not admit(request, request.num_uncomputed_tokens):
                continue
            num_new = min(cap_prefill(request.num_uncomputed_tokens, state), state.budget)
            if self._allocate_or_preempt(request, num_new, state):
                state.scheduled[request.request_id] = num_new
                state.budget -= num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, state: StepState) -> bool:
        """Allocates the request's slots, preempting lower requests until they fit.

        Returns:
            False when ``request`` itself was the lowest and got preempted.
        """
        while self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is None:
            victim = self.running[-1]  # lowest priority, latest arrival
            self._preempt(victim, state)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, state: StepState) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id, keep_hashes=True)
        num_loaded = self.connector.discard_loads(request.request_id) if self.connector is not None else 0
        if num_loaded:  # admitted this step with fetched blocks it will now recompute: they served nothing
            self.kvstore_hit_tokens -= num_loaded * self.kv.block_size
            if request.num_preemptions == 0:  # its counts were set at this admission
                request.num_cached_tokens -= request.num_kvstore_tokens
                request.num_kvstore_tokens = 0
        state.budget += state.scheduled.pop(request.request_id, 0)
        state.preempted.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.preempted_at_ns.append(time.time_ns())
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
        if state.waiting_order is not None:  # shortest first: this step's order takes it too
            insert_preempted(state.waiting_order, request)

    def _pending_hashes(self) -> set:
        """Full prompt blocks that running requests are computing now (see
        ``_schedule_waiting``: in-flight prefix sharing)."""
        pending = set()
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                pending.update(self.kv.pending_block_hashes(request))
        return pending

    def _schedule_waiting(self, state: StepState, had_running: bool, admit: Admit | None = None) -> None:
        """Admits waiting requests in order (see the module doc; ``prefill_order`` "shortest":
        in ``shortest_first`` order).

        In-flight prefix sharing: a request whose next uncached prompt block is
        being computed by a running request (the same system prompt, arrived
        together) is skipped this step, so it reads that block from the prefix
        cache a step later instead of computing it again; requests behind it
        may go first. The wait is bounded by the other request's prefill.
        """
        deadline = batching_hold_deadline(self.config, self.running, self.waiting, state.budget, self.clock())
        if deadline is not None:
            self.hold_deadline = deadline
            return
        pending = self._pending_hashes() if self.waiting else set()
        shortest = self.config.prefill_order == "shortest"
        if shortest and state.waiting_order is None:  # once a step: the second pass goes on with what is left
            state.waiting_order = shortest_first(self.waiting, self._num_cached_or_loadable)
        order = state.waiting_order if shortest else self.waiting
        index = 0
        while index < len(order) and state.budget > 0:
            request = order[index]
            if len(self.running) >= self.config.max_num_seqs and self.running[-1].priority >= request.priority:
                return  # no slot, and none to take: nor for the requests behind (no higher priority)
            # a waiting request holds no block (new, or preempted and freed)
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_ext = self._num_loadable_blocks(request, len(computed_blocks)) * self.kv.block_size
            verdict = True if admit is None else admit(request, request.num_tokens - num_hit - num_ext)
            if verdict is None:
                return
            if not verdict:
                index += 1
                continue
            if pending and self.kv.next_cacheable_hash(request, num_hit + num_ext) in pending:
                state.deferred_for_prefix.add(request.request_id)  # before taking a slot: it waits either way
                index += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_lower(request, state):
                    pending = self._pending_hashes()  # the victim computes nothing now
                    continue
                return
            num_new = cap_prefill(request.num_tokens - num_hit - num_ext, state)
            if num_new > state.budget and not may_chunk(self.config, request, num_new):
                return
            num_new = min(num_new, state.budget)
            new_blocks = self.kv.allocate_slots(request.request_id, num_hit + num_ext + num_new, computed_blocks)
            if new_blocks is None:
                if self._preempt_lower(request, state):
                    pending = self._pending_hashes()
                    continue
                return  # head-of-line waits for blocks; running requests free them
            order.pop(index)
            if shortest:
                self.waiting.remove(request)
            if self.connector is not None:  # the first new blocks receive the fetched payloads this step
                self.connector.update_state_after_alloc(request, len(computed_blocks), new_blocks)
            if had_running and request.num_preemptions == 0:
                self.num_joined_running_batch += 1
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit + num_ext
                request.num_kvstore_tokens = num_ext
            self.prefix_cache_queried_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += num_hit
            self.kvstore_hit_tokens += num_ext
            request.num_computed_tokens = num_hit + num_ext
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            state.scheduled[request.request_id] = num_new
            state.budget -= num_new
            if self.kv.enable_caching:
                pending.update(self.kv.pending_block_hashes(request))

    def _num_cached_or_loadable(self, request: Request) -> int:
        """Tokens of ``request`` it will not compute: its local prefix-cache hit and the
        fetched blocks that continue it (``shortest_first``'s measure)."""
        num_hit = self.kv.num_cached_tokens(request)
        return num_hit + self._num_loadable_blocks(request, num_hit // self.kv.block_size) * self.kv.block_size

    def _num_loadable_blocks(self, request: Request, num_hit_blocks: int) -> int:
        """Fetched blocks that continue the local prefix hit, keeping the last prompt
        token uncomputed like a local hit (0 without a connector)."""
        return self.connector.num_loadable_blocks(request, num_hit_blocks) if self.connector else 0

    def _preempt_lower(self, request: Request, state: StepState) -> bool:
        """Preempts the lowest running request if its priority is strictly lower than
        ``request``'s (making room for it); returns whether it did."""
        if not self.running or self.running[-1].priority >= request.priority:
            return False
        self._preempt(self.running[-1], state)
        return True

    def _scheduled_request(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sampling_params=request.sampling_params,
            sample=sample,
            all_token_ids=request.all_token_ids,  # a view for penalties / min_tokens, not a copy
            num_prompt_tokens=request.num_prompt_tokens,
            grammar_bitmask=request.grammar.bitmask() if sample and request.grammar is not None else None,
        )

    # -- update ---------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Advances ``num_computed_tokens``, appends sampled tokens, applies stop
        conditions and frees finished requests' blocks.

        Returns:
            One output per request that got a token this step.
        """
        if self.connector is not None and runner_output.kv_saved:
            self.connector.publish(scheduler_output, runner_output, self.requests)
        outputs = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since schedule()
            start = request.num_computed_tokens
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            self.num_prompt_tokens += max(0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            token = runner_output.sampled_token_ids.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that is not the last
            # a grammar refuses a token only where it allowed none (a rule with no sentence the tokenizer can
            # form: the row was all -inf, its token arbitrary, its logprob NaN): the request ends without it
            dead_end = request.grammar is not None and not request.grammar.accept(token)
            if dead_end:
                log.warning("request %s: its grammar allows no token (it refused %d); it ends", request.request_id,
                            token)
                status = RequestStatus.FINISHED_STOPPED
            else:
                request.append_output(token)
                self.num_generation_tokens += 1
                status = check_stop(request, self.eos_token_ids)
            if status is not None:
                self._finish(request, status)
            logprobs = None if dead_end else runner_output.logprobs.get(request.request_id)
            preempted_at_ns, request.preempted_at_ns = tuple(request.preempted_at_ns), []
            outputs.append(RequestOutput(request.request_id, [] if dead_end else [token], status is not None,
                                         status.finish_reason if status else None, request.num_cached_tokens,
                                         logprobs=None if logprobs is None else [logprobs],
                                         prompt_logprobs=runner_output.prompt_logprobs.get(request.request_id),
                                         num_kvstore_tokens=request.num_kvstore_tokens,
                                         preempted_at_ns=preempted_at_ns))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        if self.connector is not None:
            self.connector.request_finished(request.request_id)
        self.kv.free(request.request_id)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self.num_finished += 1
