"""One step's token budget: what ``BatchScheduler.schedule`` shares out, and the rules that bound a share.

A step has ``max_num_batched_tokens`` to give (``StepState.budget``); each request
it schedules takes its share from it (``StepState.scheduled``), and one preempted
in the same step gives its share back.

A prefill chunk is at most ``long_prefill_token_threshold`` tokens when that is
set and the step has more than one request to serve (vLLM v1's rule of the same
name; a lone request keeps the whole budget, there is nobody to keep waiting): a
long prompt then spreads over several steps, and the steps it shares with
decodes and with short prefills (a prefix-cache hit computes only its uncached
tail) stay short, as Sarathi-Serve's stall-free batching bounds a step's prefill
work (Agrawal et al., OSDI '24) (``cap_prefill``). A waiting request's prefill
that does not fit what is left of the budget is cut to fit only with chunked
prefill on, or when it was preempted and is longer than the whole budget
(``may_chunk``); otherwise the step admits no more waiting requests.

Dynamic batching wait (``max_batch_wait_ms`` > 0, TGI's ``max_waiting_tokens``
idea in wall-clock form): while the running batch plus the waiting new requests
leave ``max_num_seqs`` room and their prompt tokens do not fill the step budget,
new (never preempted) requests are held until the oldest of them has waited
``max_batch_wait_ms``, never longer; ``hold_deadline`` tells the engine loop when
to look again (``batching_hold_deadline``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from executor.engine.config import BatchSchedulerConfig
from executor.engine.request import Request


@dataclass
class StepState:
    """The step ``BatchScheduler.schedule`` is building: its budget left (tokens) and
    the requests it took, in batch order."""

    budget: int
    scheduled: dict[str, int]    # request id -> tokens this step (insertion order = batch order)
    preempted: list[str]
    prefill_cap: int = 0         # most prompt tokens of one request this step (0: no cap)
    deferred_for_prefix: set[str] = field(default_factory=set)
    waiting_order: list[Request] | None = None  # prefill_order "shortest": the waiting requests not yet taken


def cap_prefill(num_new: int, state: StepState) -> int:
    """``num_new`` uncomputed tokens capped at the step's ``prefill_cap`` (a decode's
    one token is never capped)."""
    return min(num_new, state.prefill_cap) if state.prefill_cap > 0 else num_new


def may_chunk(config: BatchSchedulerConfig, request: Request, num_new: int) -> bool:
    """Chunked prefill on; or off, but a preempted request longer than the whole
    budget must recompute in chunks or it would never run again."""
    return config.enable_chunked_prefill or (
        request.num_preemptions > 0 and num_new > config.max_num_batched_tokens)


def batching_hold_deadline(config: BatchSchedulerConfig, running: Sequence[Request], waiting: Sequence[Request],
                           budget: int, now: float) -> float | None:
    """When new prefills stop waiting to be batched with later arrivals (see the
    module doc; the clock's seconds), or None when they do not wait this step:
    no wait configured, nothing waiting, a preempted request among them, the batch
    full, their prompts filling the ``budget`` (tokens left), or the wait over at ``now``."""
    wait_s = config.max_batch_wait_ms / 1000.0
    if wait_s <= 0 or not waiting or any(r.num_preemptions for r in waiting):
        return None
    if len(running) + len(waiting) >= config.max_num_seqs:
        return None
    if sum(r.num_uncomputed_tokens for r in waiting) >= budget:
        return None
    deadline = min(r.arrival_time for r in waiting) + wait_s
    return deadline if now < deadline else None
