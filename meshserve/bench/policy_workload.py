"""The policies benchmark's workload, outcomes and statistics (pure: no mesh, no gRPC).

``make_jobs`` draws seeded requests (log-normal lengths, Poisson arrivals,
ordinary token ids); ``Outcome`` is what a client saw of one call;
``latency_stats``, ``ttft_stats`` and ``call_counts`` summarise an arm;
``arm_order``, ``tenants_toml`` and ``a_clients`` set up the experiments of
``meshserve.bench.policies``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshserve.bench.stats import percentile

TENANT_KEYS = {"a": "key-a", "b": "key-b"}


@dataclass(frozen=True)
class Job:
    """One request of an experiment.

    Attributes:
        request_id: unique id.
        tenant: tenant name ("default" for the open gateway, "a", "b").
        arrival_s: send time after the start of its arm (seconds; 0 for closed-loop).
        prompt_token_ids: prompt ids (ordinary vocabulary ids).
        output_len: exact tokens to generate (``max_tokens``, ``ignore_eos``).
    """

    request_id: str
    tenant: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def size(self) -> int:
        """True size: prompt + output tokens."""
        return len(self.prompt_token_ids) + self.output_len


@dataclass(frozen=True)
class JobSpec:
    """Shape of a seeded open-loop stream (lengths in tokens, rate in requests/s).

    Lengths are ``round(exp(N(ln median, sigma)))`` clipped to the range.
    """

    num_requests: int
    prompt_median: int = 48
    prompt_sigma: float = 0.5
    prompt_range: tuple[int, int] = (16, 128)
    output_median: int = 12
    output_sigma: float = 1.2
    output_range: tuple[int, int] = (2, 128)
    rate: float = 8.0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate <= 0:
            raise ValueError(f"num_requests must be >= 1 and rate > 0, got {self.num_requests}, {self.rate}")
        for name, median, (lo, hi) in (("prompt", self.prompt_median, self.prompt_range),
                                       ("output", self.output_median, self.output_range)):
            if not 1 <= lo <= median <= hi:
                raise ValueError(f"{name} median {median} must lie in [{lo}, {hi}] with lo >= 1")


def make_jobs(spec: JobSpec, seed: int, vocab_size: int, special_ids: frozenset[int] = frozenset(), *,
              tenant: str = "default", prefix: str = "job") -> list[Job]:
    """The seeded stream of ``spec``: ``numpy.random.default_rng(seed)`` draws, in this
    order, the prompt lengths, the output lengths, the inter-arrival gaps (exponential,
    mean ``1 / rate``; the first request arrives after one gap) and all prompt ids
    (uniform over ``[0, vocab_size)`` minus ``special_ids``). Same arguments, same jobs.

    Raises:
        ValueError: no ordinary id left.
    """
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(special_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("the vocabulary has no ordinary id")
    rng = np.random.default_rng(seed)
    n = spec.num_requests

    def lengths(median, sigma, bounds):
        return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), *bounds).astype(np.int64)

    prompts = lengths(spec.prompt_median, spec.prompt_sigma, spec.prompt_range)
    outputs = lengths(spec.output_median, spec.output_sigma, spec.output_range)
    arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, n))
    ids = allowed[rng.integers(0, allowed.size, int(prompts.sum()))]
    chunks = np.split(ids, np.cumsum(prompts)[:-1])
    return [Job(f"{prefix}-{i}", tenant, float(a), tuple(int(t) for t in c), int(o))
            for i, (c, o, a) in enumerate(zip(chunks, outputs, arrivals))]


def log_sigma(values: list[int]) -> float:
    """Population standard deviation of ``ln(value)``."""
    logs = [math.log(v) for v in values]
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))


@dataclass
class Outcome:
    """What the client saw of one call (times in seconds, ``time.monotonic``).

    Attributes:
        job: the request.
        sent: when the call started.
        finished: when it ended (last token or error).
        ttft_s: send → first token (client side); None without a token.
        queue_s: the gateway's arrival → assignment; None on error.
        num_tokens: tokens received.
        queue_updates: queue events received.
        error: gRPC status name ("RESOURCE_EXHAUSTED"…), or "" on success, or
            "TOKEN_COUNT" when the token count differs from ``output_len``.
    """

    job: Job
    sent: float
    finished: float
    ttft_s: float | None = None
    queue_s: float | None = None
    num_tokens: int = 0
    queue_updates: int = 0
    error: str = ""

    @property
    def latency_s(self) -> float:
        return self.finished - self.sent


def latency_stats(outcomes: list[Outcome]) -> dict:
    """Latency figures of one ``sjf-vs-fcfs`` arm (successful calls only).

    Halves by true size (prompt + output, ties by request id); the shorter half
    has ``n // 2`` requests. ``max_wait_s`` is the largest ``queue_s``.

    Raises:
        ValueError: fewer than 2 successful calls.
    """
    ok = [o for o in outcomes if not o.error]
    if len(ok) < 2:
        raise ValueError(f"need at least 2 successful calls, got {len(ok)}")
    by_size = sorted(ok, key=lambda o: (o.job.size, o.job.request_id))
    half = len(by_size) // 2
    short = [o.latency_s for o in by_size[:half]]
    long = [o.latency_s for o in by_size[half:]]
    waits = [o.queue_s for o in ok if o.queue_s is not None]
    span = max(o.finished for o in ok) - min(o.sent for o in ok)
    return {
        "num_ok": len(ok), "num_errors": len(outcomes) - len(ok),
        "short_half_mean_latency_s": sum(short) / len(short),
        "short_half_p99_latency_s": percentile(short, 99, "nearest-rank"),
        "long_half_mean_latency_s": sum(long) / len(long),
        "long_half_p99_latency_s": percentile(long, 99, "nearest-rank"),
        "mean_latency_s": sum(short + long) / len(ok),
        "max_wait_s": max(waits) if waits else None,
        "mean_wait_s": sum(waits) / len(waits) if waits else None,
        "queued_calls": sum(1 for o in ok if o.queue_updates > 0),
        "throughput_requests_per_s": len(ok) / span if span > 0 else None,
    }


def ttft_stats(outcomes: list[Outcome]) -> dict:
    """TTFT figures of successful calls: count, p50, p99, mean, max (seconds; None for none)."""
    t = [o.ttft_s for o in outcomes if not o.error and o.ttft_s is not None]
    if not t:
        return {"num_ok": 0, "ttft_p50_s": None, "ttft_p99_s": None, "ttft_mean_s": None, "ttft_max_s": None}
    return {"num_ok": len(t), "ttft_p50_s": percentile(t, 50, "nearest-rank"),
            "ttft_p99_s": percentile(t, 99, "nearest-rank"),
            "ttft_mean_s": sum(t) / len(t), "ttft_max_s": max(t)}


def call_counts(outcomes: list[Outcome]) -> dict:
    """Calls, successes, refusals (RESOURCE_EXHAUSTED), other errors and queued calls."""
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {"calls": len(outcomes), "ok": sum(1 for o in outcomes if not o.error),
            "resource_exhausted": errors.get("RESOURCE_EXHAUSTED", 0), "errors": errors,
            "queued": sum(1 for o in outcomes if o.queue_updates > 0)}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    return None if a is None or not b else a / b


def arm_order(arms: tuple[str, str], rounds: int) -> list[str]:
    """The arms of ``rounds`` rounds, alternating which goes first: (x, y), (y, x), …"""
    out: list[str] = []
    for r in range(rounds):
        out.extend(arms if r % 2 == 0 else arms[::-1])
    return out


def tenants_toml(quota_blocks: int) -> str:
    """The quota-isolation tenants file: ``a`` with the quota, ``b`` without."""
    return (f'[[tenants]]\nname = "a"\napi_keys = ["{TENANT_KEYS["a"]}"]\nkv_quota_blocks = {quota_blocks}\n\n'
            f'[[tenants]]\nname = "b"\napi_keys = ["{TENANT_KEYS["b"]}"]\n')


def a_clients(quota_blocks: int, demand_factor: float, prompt_len: int, block_size: int) -> int:
    """Closed-loop clients of tenant A that keep ``demand_factor`` × its quota in demand:
    each call is charged ``ceil((prompt + 1) / block_size)`` blocks at admission."""
    per_call = math.ceil((prompt_len + 1) / block_size)
    return max(1, math.ceil(demand_factor * quota_blocks / per_call))
