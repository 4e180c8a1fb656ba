"""Prefix-routing simulation: shared system prompts over executors with finite prefix caches.

Workload ``prefix-routing`` (seeded): ``num_system_prompts`` distinct system
prompts of ``system_prompt_tokens`` tokens each; a request is one system prompt
(popularity Zipf with exponent ``zipf_s``: prompt k is chosen with probability
∝ 1 / (k + 1) ** zipf_s) followed by a unique question (log-normal, median
``question_median`` tokens, σ 0.5) and generates a log-normal number of tokens
(median ``output_median``, σ 0.5). Arrivals are Poisson at ``rate`` requests/s.
Executors and scheduler: ``meshserve.bench.sim.loop`` (the real admission core,
prefix index and routing cost).

Report:

* ``hit_rate``: prompt tokens served from prefix caches / prompt tokens;
* ``ideal_hit_rate``: the same with one unbounded cache shared by all, where
  every request but the first of each system prompt hits the prompt's full
  blocks (questions are unique and never hit);
* ``hit_rate_vs_ideal`` = ``hit_rate / ideal_hit_rate`` (goal ≥ 0.8);
* ``busiest_over_mean``: the busiest executor's busy time (seconds spent in
  steps) / the mean busy time (goal ≤ 1.5);
* TTFT p50 / p99, requests per executor.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace

from meshserve.bench.sim.loop import Job, MeshSimConfig, simulate
from meshserve.bench.stats import percentile
from meshserve.block_hash import routing_block_hashes


@dataclass(frozen=True)
class RoutingSimConfig:
    """Workload of the prefix-routing simulation (see the module docstring)."""

    seed: int = 0
    num_requests: int = 2000
    rate: float = 40.0
    num_system_prompts: int = 8
    system_prompt_tokens: int = 512
    zipf_s: float = 1.0
    question_median: float = 64.0
    output_median: float = 64.0
    mesh: MeshSimConfig = MeshSimConfig()


def workload(cfg: RoutingSimConfig) -> list[Job]:
    """The seeded jobs (see the module docstring); token ids are synthetic and distinct."""
    rng = random.Random(cfg.seed)
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)]
    systems = [[1_000_000 + 10_000 * k + i for i in range(cfg.system_prompt_tokens)]
               for k in range(cfg.num_system_prompts)]
    jobs, t = [], 0.0
    for i in range(cfg.num_requests):
        t += rng.expovariate(cfg.rate)
        k = rng.choices(range(cfg.num_system_prompts), weights)[0]
        q = max(1, round(cfg.question_median * math.exp(rng.gauss(0, 0.5))))
        out = max(1, round(cfg.output_median * math.exp(rng.gauss(0, 0.5))))
        tokens = systems[k] + [2_000_000 + i * 4096 + j for j in range(q)]  # unique question
        hashes = routing_block_hashes(tokens, cfg.mesh.block_size, "sim", "r0")
        jobs.append(Job("t", len(tokens), out, hashes, arrival=t, group=k))
    return jobs


def ideal_hit_tokens(cfg: RoutingSimConfig, jobs: list[Job]) -> int:
    """Hits with one unbounded shared cache: the system prompt's full blocks, from its second use on."""
    full = cfg.system_prompt_tokens // cfg.mesh.block_size * cfg.mesh.block_size
    seen, total = set(), 0
    for job in sorted(jobs, key=lambda j: j.arrival):
        if job.group in seen:
            total += min(full, job.prompt_len - 1)
        seen.add(job.group)
    return total


def run(cfg: RoutingSimConfig) -> dict:
    """Simulates the workload and returns the report (see the module docstring)."""
    jobs = workload(cfg)
    reqs, executors, _ = simulate(cfg.mesh, jobs)
    prompt_tokens = sum(j.prompt_len for j in jobs)
    hit_rate = sum(r.hit_tokens for r in reqs) / prompt_tokens
    ideal = ideal_hit_tokens(cfg, jobs) / prompt_tokens
    busy = [e.busy_s for e in executors.values()]
    ttft = [r.first_token - r.arrival for r in reqs]
    return {
        "workload": "prefix-routing", "routing": cfg.mesh.routing, "seed": cfg.seed, "num_requests": len(reqs),
        "hit_rate": hit_rate, "ideal_hit_rate": ideal, "hit_rate_vs_ideal": hit_rate / ideal,
        "busiest_over_mean": max(busy) / (sum(busy) / len(busy)),
        "busy_s": {eid: e.busy_s for eid, e in executors.items()},
        "requests_per_executor": {eid: sum(r.executor_id == eid for r in reqs) for eid in executors},
        "ttft_p50_s": percentile(ttft, 50, "nearest-rank"), "ttft_p99_s": percentile(ttft, 99, "nearest-rank"),
        "config": {**asdict(cfg), "mesh": {**asdict(cfg.mesh), "tenant_quotas": dict(cfg.mesh.tenant_quotas)}},
    }


def compare(cfg: RoutingSimConfig) -> dict:
    """``run`` with prefix routing, plus the least-loaded baseline's figures under ``baseline``."""
    report = run(cfg)
    base = run(replace(cfg, mesh=replace(cfg.mesh, routing="least-loaded")))
    report["baseline"] = {k: base[k] for k in ("routing", "hit_rate", "hit_rate_vs_ideal", "busiest_over_mean",
                                               "ttft_p50_s", "ttft_p99_s")}
    return report
