"""Routing: which of the candidate executors gets a request (pure policy, no gRPC).

The admission core (``scheduler.admission``) hands over the executors that may
take the request now (right model and pool, enough KV blocks, see
``scheduler.pools``) and, for each, two numbers in tokens:

* ``hit_tokens``: leading prompt tokens already in that executor's prefix cache
  (``scheduler.prefix_index``: leading blocks held × ``block_size``, at most
  ``num_prompt_tokens - 1``: on a full hit the engine still computes the last
  prompt token to sample the first output token);
* ``load_tokens``: the executor's outstanding work, Σ over its live leases of
  ``num_prompt_tokens + n × predicted_output_tokens`` less what is done: the
  prefix hit it was routed for, or the tokens of the KV blocks the lease's
  requests held at the executor's last per-lease report, whichever is larger
  (``scheduler.placement.outstanding_tokens``). "Least outstanding tokens",
  corrected by the executors' reports so that finished work stops counting.

* ``kvstore_hit_tokens``: leading prompt tokens the executor could fetch from
  the kvstore (``scheduler.kvstore_index``; only for an executor registered
  with a kvstore namespace, and only when the scheduler follows a kvstore,
  ``--kvstore``), at most ``num_prompt_tokens - 1``.

**The cost function** (one for every policy; smaller is better)::

    cost(e) = prefill_weight × (num_prompt_tokens − credited_hit(e)
                                − (1 − kvstore_token_cost) × credited_fetch(e))
            + load_weight    × load_tokens(e)

    credited_fetch(e) = max(0, kvstore_hit_tokens(e) − credited_hit(e))   (0 for least-loaded)

    credited_hit(e) = 0            if policy is "least-loaded", or e is overloaded
                      hit_tokens(e) otherwise

    overloaded(e)  ⟺  load_tokens(e) > balance_factor × mean_load
                      and load_tokens(e) − mean_load > balance_abs_tokens

with ``mean_load`` the mean ``load_tokens`` of the candidates. With both weights
1, the cost is the tokens the executor must still process, this request's own
uncached prefill included (a TTFT and latency proxy).
The load term alone already moves traffic off an executor holding a popular
prefix once its load exceeds the others' by about the prefix length; the
overload rule (two thresholds, relative and absolute, as SGLang's cache-aware
router's ``balance_rel_threshold`` / ``balance_abs_threshold``) drops the
prefix bonus of an executor far above the mean, so one executor holding a
shared system prompt cannot absorb all traffic when prompts are long and
answers short. Ties: more available blocks first, then executor id.

A prefix in the kvstore is reachable by every executor sharing that kvstore, so
its credit does not pull traffic to one executor: it only makes those executors
cheaper than ones that would recompute. A fetched token is not free: its cost
relative to a computed one is ``kvstore_token_cost`` (default 0.1; measured on
the CPU: TTFT with a 1,524-token prefix fetched was 0.08 × recompute, see
docs/benchmarks.md). The overload rule drops only the local-cache bonus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ROUTING_POLICIES = ("prefix", "least-loaded")


@dataclass(frozen=True)
class RoutingConfig:
    """Settings of the cost function (see the module docstring).

    Attributes:
        policy: ``prefix`` (credit prefix-cache hits) or ``least-loaded``.
        prefill_weight: cost of one uncached prompt token (>= 0).
        load_weight: cost of one token of an executor's load (>= 0).
        balance_factor: relative overload threshold (>= 1).
        balance_abs_tokens: absolute overload threshold (tokens, >= 0).
        kvstore_token_cost: cost of a prompt token fetched from the kvstore,
            relative to a computed one (0..1).

    Raises:
        ValueError: an unknown policy or a value out of range.
    """

    policy: str = "prefix"
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    balance_factor: float = 1.5
    balance_abs_tokens: float = 2048.0
    kvstore_token_cost: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.kvstore_token_cost <= 1.0:
            raise ValueError(f"kvstore_token_cost must be in [0, 1], got {self.kvstore_token_cost}")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r} (choose from {', '.join(ROUTING_POLICIES)})")
        if self.prefill_weight < 0 or self.load_weight < 0:
            raise ValueError("routing weights must be >= 0")
        if self.balance_factor < 1 or self.balance_abs_tokens < 0:
            raise ValueError(f"balance_factor must be >= 1 and balance_abs_tokens >= 0, got "
                             f"{self.balance_factor} and {self.balance_abs_tokens}")


@dataclass(frozen=True)
class Candidate:
    """One executor that could take the request now.

    Attributes:
        executor_id: its id.
        hit_tokens: leading prompt tokens in its prefix cache (tokens).
        load_tokens: its outstanding work (tokens, see the module docstring).
        available_blocks: KV blocks it can still give (tie-break).
        kvstore_hit_tokens: leading prompt tokens it could fetch from the kvstore.
    """

    executor_id: str
    hit_tokens: int
    load_tokens: float
    available_blocks: int
    kvstore_hit_tokens: int = 0


@dataclass(frozen=True)
class Scored:
    """A candidate's cost.

    Attributes:
        executor_id: its id.
        cost: the cost function's value (tokens when both weights are 1).
        credited_hit_tokens: prefix tokens credited (0 when overloaded or least-loaded).
        overloaded: whether the overload rule dropped its prefix bonus.
        credited_fetch_tokens: kvstore tokens credited beyond the local hit.
    """

    executor_id: str
    cost: float
    credited_hit_tokens: int
    overloaded: bool
    credited_fetch_tokens: int = 0


def score(candidates: Sequence[Candidate], num_prompt_tokens: int, config: RoutingConfig) -> list[Scored]:
    """Every candidate's cost, best first (ties: more available blocks, then id)."""
    if not candidates:
        return []
    mean_load = sum(c.load_tokens for c in candidates) / len(candidates)
    out = []
    for c in sorted(candidates, key=lambda c: (-c.available_blocks, c.executor_id)):
        overloaded = (c.load_tokens > config.balance_factor * mean_load
                      and c.load_tokens - mean_load > config.balance_abs_tokens)
        hit = 0 if overloaded or config.policy == "least-loaded" else min(c.hit_tokens, num_prompt_tokens - 1)
        hit = max(0, hit)
        fetch = 0
        if config.policy != "least-loaded":
            fetch = max(0, min(c.kvstore_hit_tokens, num_prompt_tokens - 1) - hit)
        uncached = num_prompt_tokens - hit - (1.0 - config.kvstore_token_cost) * fetch
        cost = config.prefill_weight * uncached + config.load_weight * c.load_tokens
        out.append(Scored(c.executor_id, cost, hit, overloaded, fetch))
    return sorted(out, key=lambda s: s.cost)  # stable: keeps the tie order


def route(candidates: Sequence[Candidate], num_prompt_tokens: int, config: RoutingConfig) -> Scored | None:
    """The cheapest candidate, or None when there is none."""
    scored = score(candidates, num_prompt_tokens, config)
    return scored[0] if scored else None
