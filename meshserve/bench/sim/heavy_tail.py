"""Workload ``heavy-tail``: the queue policies under a heavy-tailed output length.

The executors and the scheduler are ``meshserve.bench.sim.loop``'s (the real
``AdmissionCore``: queue policy, predictor, quotas), ``num_executors`` of them,
with no prefix hits (the prompts share nothing).

* **Workload**: ``num_tenants`` tenants; tenant k's median output
  length is ``output_median_min * (output_median_max / output_median_min) **
  (k / (num_tenants - 1))``; a request's output length is log-normal around its
  tenant's median with ``output_sigma_within``; the tenant is uniform, so the
  whole output distribution is a log-normal mixture with log-std ≈
  ``sqrt(ln(max/min)² / 12 + σ_within²)`` (reported as ``output_len_log_sigma``).
  Prompt lengths are log-normal (median ``prompt_median``, σ 0.5). Arrivals are
  Poisson at ``load`` × the saturated throughput, measured by a first run of the
  same requests all arriving at t = 0 under FCFS (``saturated_throughput``).

Report: latencies (arrival → last token) of the shortest and the longest half of
the requests by their true size (prompt + output tokens), waits (arrival →
assignment), the aging bound and the predictor's error.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from meshserve.bench.sim.loop import Job, MeshSimConfig, SimRequest, simulate as simulate_mesh
from meshserve.bench.stats import percentile
from scheduler.admission import AdmissionCore


@dataclass(frozen=True)
class HeavyTailSimConfig:
    """Workload and executor model (see the module docstring; times in seconds)."""

    policy: str = "sjf"
    seed: int = 0
    num_requests: int = 2000
    load: float = 0.9
    max_queue_wait_s: float = 60.0
    kv_reservation: str = "predicted"
    num_executors: int = 2
    num_blocks: int = 1024
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    step_base_s: float = 0.01
    step_per_token_s: float = 0.0001
    num_tenants: int = 8
    output_median_min: float = 16.0
    output_median_max: float = 1024.0
    output_sigma_within: float = 0.5
    prompt_median: float = 256.0
    max_tokens: int = 4096


def workload(cfg: HeavyTailSimConfig) -> list[tuple[str, int, int]]:
    """``(tenant, prompt_tokens, output_tokens)`` per request, seeded."""
    rng = random.Random(cfg.seed)
    ratio = cfg.output_median_max / cfg.output_median_min
    out = []
    for _ in range(cfg.num_requests):
        k = rng.randrange(cfg.num_tenants)
        median = cfg.output_median_min * ratio ** (k / max(1, cfg.num_tenants - 1))
        output = min(cfg.max_tokens, max(1, round(median * math.exp(rng.gauss(0, cfg.output_sigma_within)))))
        prompt = min(2048, max(8, round(cfg.prompt_median * math.exp(rng.gauss(0, 0.5)))))
        out.append((f"t{k}", prompt, output))
    return out


def mesh_config(cfg: HeavyTailSimConfig) -> MeshSimConfig:
    """The executors and scheduler of ``cfg``."""
    return MeshSimConfig(num_executors=cfg.num_executors, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                         max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                         step_base_s=cfg.step_base_s, step_per_token_s=cfg.step_per_token_s,
                         queue_policy=cfg.policy, max_queue_wait_s=cfg.max_queue_wait_s,
                         kv_reservation=cfg.kv_reservation)


def simulate(cfg: HeavyTailSimConfig, arrivals: list[float] | None = None,
             steps: list[tuple[float, int]] | None = None) -> tuple[list[SimRequest], AdmissionCore]:
    """Runs the workload; ``arrivals`` (seconds) overrides the Poisson arrivals; ``steps``
    collects (end time, useful tokens) of every executor step (``loop.simulate``)."""
    if arrivals is None:
        rng = random.Random(cfg.seed + 1)
        rate = cfg.load * saturated_throughput(cfg)
        t, arrivals = 0.0, []
        for _ in range(cfg.num_requests):
            t += rng.expovariate(rate)
            arrivals.append(t)
    jobs = [Job(tenant, prompt, output, [], arrival=a, max_tokens=cfg.max_tokens)
            for (tenant, prompt, output), a in zip(workload(cfg), arrivals)]
    reqs, _, core = simulate_mesh(mesh_config(cfg), jobs, steps=steps)
    return reqs, core


def saturated_throughput(cfg: HeavyTailSimConfig) -> float:
    """Requests per second at saturation: the useful token rate (prompt + output tokens processed
    per second, all executors, less the tokens preemptions threw away and had recomputed) of a
    run where every request arrives at t = 0 (FCFS), measured until 60 % of them finished (the
    drain at the end would understate it), divided by the mean tokens of a request.

    Counting recomputed tokens as work would overstate capacity by the preemption waste, and
    "90 % load" would be an overload whose queue (and every policy's max wait) grows without
    bound over the run."""
    steps: list[tuple[float, int]] = []
    reqs, _ = simulate(HeavyTailSimConfig(**{**asdict(cfg), "policy": "fcfs"}), arrivals=[0.0] * cfg.num_requests,
                       steps=steps)
    until = sorted(r.finished for r in reqs)[(6 * len(reqs)) // 10]
    token_rate = sum(n for t, n in steps if t <= until) / until
    return token_rate / (sum(r.prompt + r.output for r in reqs) / len(reqs))


def run(cfg: HeavyTailSimConfig) -> dict:
    """Simulates and returns the report (see the module docstring)."""
    reqs, core = simulate(cfg)
    by_size = sorted(reqs, key=lambda r: (r.prompt + r.output, r.rid))
    half = len(by_size) // 2
    short = [r.finished - r.arrival for r in by_size[:half]]
    long = [r.finished - r.arrival for r in by_size[half:]]
    logs = [math.log(r.output) for r in reqs]
    mean_log = sum(logs) / len(logs)
    span = max(r.finished for r in reqs) - min(r.arrival for r in reqs)
    return {
        "policy": cfg.policy, "seed": cfg.seed, "num_requests": len(reqs), "workload": "heavy-tail",
        "short_half_mean_latency_s": sum(short) / len(short),
        "short_half_p99_latency_s": percentile(short, 99, "nearest-rank"),
        "long_half_mean_latency_s": sum(long) / len(long),
        "long_half_p99_latency_s": percentile(long, 99, "nearest-rank"),
        "mean_latency_s": sum(short + long) / len(reqs),
        "max_wait_s": max(r.assigned - r.arrival for r in reqs),
        "aging_bound_s": cfg.max_queue_wait_s,
        "output_len_log_sigma": math.sqrt(sum((x - mean_log) ** 2 for x in logs) / len(logs)),
        "throughput_requests_per_s": len(reqs) / span,
        "predictor": core.predictor.stats(),
        "config": asdict(cfg),
    }
