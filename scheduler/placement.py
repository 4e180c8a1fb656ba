"""Placement: which executor a queued request goes to now (pools, room, routing).

Pure, no gRPC. For one request the admission core asks ``choose``:

1. **executors of its model** that could ever hold it (prompt + 1 token within
   ``max_model_len`` and one choice's blocks within the whole cache);
2. **room**: within its tenant's quota (the blocks it needs there, with what
   the tenant holds, at most ``kv_quota_blocks``: block sizes and cache caps
   make that differ between executors), not draining (an executor that stops
   takes nothing new), available blocks (reported free minus pending promises, see
   ``scheduler.registry``) >= the blocks the request needs, and no more than
   ``max_engine_waiting`` requests (default 0) waiting inside its engine — an
   engine that already queues work (batch full, KV short) gets no more, so the
   queue stays in the scheduler where the queue policy (SJF, priority) orders
   it, instead of in the engines' first-come queues;
3. **pool**: its own pool's executors with room, else an idle spill target's
   (``scheduler.pools``);
4. **routing**: the cheapest of those by the cost function of
   ``scheduler.routing``, fed with each executor's prefix-cache hit
   (``scheduler.prefix_index``; counted only when the gateway hashed the prompt
   with the executor's ``block_size``) and its outstanding work in tokens
   (``load_tokens``).

Blocks of a request: ``ceil((num_prompt_tokens + 1) / block_size)`` per choice,
times ``n`` choices (each choice is its own engine request with its own copy of
the prompt: sharing happens only through the prefix cache, so it is not
assumed), capped at the executor's whole cache (the engine runs the choices in
turn when they do not fit at once). That is what a lease reserves (and charges
to its tenant's quota) until the executor reports it.

**KV reservation for output** (``kv_reservation``). With ``prompt`` (default),
room is checked against the prompt's blocks only: executors take requests while
their prompts fit and preempt (recompute) when decodes outgrow the cache, as
vLLM's engine does on its own. With ``predicted``, room also counts the output
still to come, from the output-length predictor (``scheduler.predictor``):

    need(req)       = min(n * ceil((num_prompt_tokens + predicted_output_tokens + 1) / block_size),
                          num_blocks)
    growth(e)       = Σ over e's leases of max(0, need(lease) - lease.num_blocks)
    room(e, req)    = available_blocks(e) - growth(e) >= need(req)

so an executor is not handed more work than its cache can finish without
preemption (if the predictions hold), and the queue forms in the scheduler,
where the queue policy orders it, rather than as recompute churn in the
engines. A request an empty executor cannot hold by its prediction is still
placed there (``need`` is capped at the whole cache). The lease still reserves
only its prompt blocks: the growth term is what keeps room for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from scheduler.kvstore_index import KVStoreIndex
from scheduler.pools import PoolChoice, PoolsConfig, candidate_executors, reachable_pools
from scheduler.prefix_index import PrefixIndex
from scheduler.registry import ExecutorRegistry, ExecutorState
from scheduler.routing import Candidate, RoutingConfig, Scored, route


class Placeable(Protocol):
    """What placement reads of a request (``scheduler.admission_queue.AdmissionRequest``)."""

    model: str
    priority: int
    num_prompt_tokens: int
    n: int
    predicted_output_tokens: int
    block_hashes: Sequence[bytes]
    hash_block_size: int


@dataclass(frozen=True)
class Placement:
    """A chosen executor.

    Attributes:
        executor: where the request goes.
        num_blocks: KV blocks admission reserves for it there.
        hit_tokens: prompt tokens expected from that executor's prefix cache
            (whether or not routing credited them), at most ``num_prompt_tokens - 1``.
        pool: the pool it runs in (None without a pools file).
        spilled: True when it runs in a spill target, not its own pool.
        scored: the routing cost of the chosen executor.
    """

    executor: ExecutorState
    num_blocks: int
    hit_tokens: int
    pool: str | None
    spilled: bool
    scored: Scored


def blocks_per_choice(e: ExecutorState, num_prompt_tokens: int) -> int:
    """``ceil((num_prompt_tokens + 1) / block_size)`` (blocks)."""
    return math.ceil((num_prompt_tokens + 1) / e.block_size)


KV_RESERVATIONS = ("prompt", "predicted")


def blocks_with_output(e: ExecutorState, num_prompt_tokens: int, n: int, predicted_output_tokens: int) -> int:
    """``min(n * ceil((num_prompt_tokens + predicted_output_tokens + 1) / block_size), num_blocks)``."""
    per_choice = math.ceil((num_prompt_tokens + max(0, predicted_output_tokens) + 1) / e.block_size)
    return min(max(1, n) * per_choice, e.num_blocks)


def growth_blocks(e: ExecutorState) -> int:
    """Blocks ``e``'s leases are predicted to grow into beyond their current charge (blocks)."""
    return sum(max(0, blocks_with_output(e, lease.num_prompt_tokens, lease.n, lease.predicted_output_tokens or 0)
                   - lease.num_blocks) for lease in e.leases.values())


def blocks_needed(e: ExecutorState, req: Placeable) -> int:
    """n choices' blocks on ``e``, at most its whole cache (blocks)."""
    return min(max(1, req.n) * blocks_per_choice(e, req.num_prompt_tokens), e.num_blocks)


def fits_ever(e: ExecutorState, req: Placeable) -> bool:
    """Whether ``e`` could hold the request with its whole cache free."""
    return req.num_prompt_tokens + 1 <= e.max_model_len and blocks_per_choice(e, req.num_prompt_tokens) <= e.num_blocks


def outstanding_tokens(lease) -> int:
    """Tokens a lease still has to process: uncached prompt + n × predicted output, less the
    tokens its requests hold in KV beyond the hit (from the executor's last per-lease report)."""
    total = lease.num_prompt_tokens + lease.n * (lease.predicted_output_tokens or 0)
    done = max(lease.num_hit_tokens, lease.reported_tokens or 0)
    return max(0, total - done)


def load_tokens(e: ExecutorState) -> float:
    """The executor's outstanding work: Σ ``outstanding_tokens`` over its live leases."""
    return float(sum(outstanding_tokens(lease) for lease in e.leases.values()))


class Placer:
    """Chooses executors over a registry, a prefix index, pools and a routing config."""

    def __init__(self, registry: ExecutorRegistry, prefix_index: PrefixIndex, pools: PoolsConfig | None,
                 routing: RoutingConfig, pending_timeout_s: float, max_engine_waiting: int | None = 0,
                 kv_reservation: str = "prompt", kvstore_index: KVStoreIndex | None = None):
        if kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"unknown kv_reservation {kv_reservation!r} (choose from {', '.join(KV_RESERVATIONS)})")
        self.kv_reservation = kv_reservation
        self.kvstore_index = kvstore_index
        self.max_engine_waiting = max_engine_waiting
        self.registry = registry
        self.prefix_index = prefix_index
        self.pools = pools
        self.routing = routing
        self.pending_timeout_s = pending_timeout_s

    def executors_for(self, req: Placeable) -> list[ExecutorState]:
        """Executors of the request's model in a pool it may ever use (own or spill target)."""
        pools = reachable_pools(self.pools, req.priority)
        return [e for e in self.registry
                if (not req.model or e.model == req.model) and (pools is None or e.pool in pools)]

    def hit_tokens(self, e: ExecutorState, req: Placeable, hits: dict[str, int]) -> int:
        """Prefix tokens of the request cached on ``e`` (0 unless hashed with e's block size)."""
        if req.hash_block_size != e.block_size:
            return 0
        return hits.get(e.executor_id, 0) * e.block_size

    def kvstore_hit_tokens(self, e: ExecutorState, req: Placeable) -> int:
        """Leading prompt tokens ``e`` could fetch from the kvstore (0 without a shared
        namespace, a followed kvstore, or hashes in e's block size)."""
        if (self.kvstore_index is None or not e.kvstore_namespace or not req.block_hashes
                or req.hash_block_size != e.block_size):
            return 0
        return self.kvstore_index.hit_blocks(e.kvstore_namespace, req.block_hashes) * e.block_size

    def is_idle(self, e: ExecutorState, now: float, free_fraction: float) -> bool:
        """No request waiting in its engine and >= ``free_fraction`` of its blocks available."""
        return e.num_waiting == 0 and e.available_blocks(now, self.pending_timeout_s) >= free_fraction * e.num_blocks

    def choose(self, req: Placeable, now: float,
               quota_allows: Callable[[int], bool] | None = None) -> tuple[Placement | None, PoolChoice]:
        """The executor for ``req`` now, or None (wait), and the pool choice behind it.

        ``quota_allows(blocks)``: whether the request's tenant may take that many more
        blocks now; an executor where ``blocks_needed`` exceeds what it allows is no
        candidate (None: no quota).
        """
        def has_room(e: ExecutorState) -> bool:
            if quota_allows is not None and not quota_allows(blocks_needed(e, req)):
                return False  # its tenant's quota does not cover the blocks it needs there
            if e.draining:
                return False  # it finishes what it holds and leaves
            if self.max_engine_waiting is not None and e.num_waiting > self.max_engine_waiting:
                return False  # its engine already queues work: keep the queue here, where the policy orders it
            if not fits_ever(e, req):
                return False
            available = e.available_blocks(now, self.pending_timeout_s)
            if self.kv_reservation == "predicted":
                need = blocks_with_output(e, req.num_prompt_tokens, req.n, req.predicted_output_tokens)
                return available - growth_blocks(e) >= need
            return available >= blocks_needed(e, req)

        choice = candidate_executors(self.pools, req.priority, self.executors_for(req), has_room,
                                     lambda e, fraction: self.is_idle(e, now, fraction))
        if not choice.executors:
            return None, choice
        hits = self.prefix_index.hit_blocks(req.block_hashes) if req.block_hashes else {}
        candidates = [Candidate(e.executor_id, self.hit_tokens(e, req, hits),
                                load_tokens(e),
                                e.available_blocks(now, self.pending_timeout_s),
                                self.kvstore_hit_tokens(e, req)) for e in choice.executors]
        best = route(candidates, req.num_prompt_tokens, self.routing)
        executor = self.registry.get(best.executor_id)
        hit = min(next(c.hit_tokens for c in candidates if c.executor_id == best.executor_id),
                  max(0, req.num_prompt_tokens - 1))
        return Placement(executor, blocks_needed(executor, req), hit, choice.pool, choice.spilled, best), choice
