"""Quota-isolation simulation: a tenant flooding at 10× its KV quota beside a normal tenant.

Workload ``quota-isolation`` (seeded), on ``meshserve.bench.sim.loop``'s executors:

* tenant **B**: ``num_b_requests`` open-loop requests, Poisson at ``b_rate``
  requests/s, prompts log-normal around ``prompt_median`` tokens (σ 0.5),
  outputs log-normal around ``output_median`` tokens (σ 0.5);
* tenant **A**: KV quota ``a_quota_blocks``; ``a_overload`` × as many
  closed-loop clients as the quota admits at once
  (``a_quota_blocks // blocks of one A request``), each sending its next
  request as soon as the previous one finishes (A's demand stays at
  ``a_overload`` × its quota for the whole run); A's requests have prompts of
  ``a_prompt_tokens`` and outputs of ``a_output_tokens``.

Three runs on the same B requests: B and A with A's quota, B alone, and B and
A without quota (the baseline that shows what the quota prevents). Report:
B's TTFT p50/p99 in each, ``b_p99_ratio`` = B's p99 TTFT with A / B's p99
alone (goal ≤ 1.5) and ``b_p99_ratio_without_quota``.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace

from meshserve.bench.sim.loop import Job, MeshSimConfig, simulate
from meshserve.bench.stats import percentile


@dataclass(frozen=True)
class IsolationSimConfig:
    """Workload of the quota-isolation simulation (see the module docstring)."""

    seed: int = 0
    num_b_requests: int = 400
    b_rate: float = 8.0
    prompt_median: float = 256.0
    output_median: float = 64.0
    a_quota_blocks: int = 32
    a_overload: int = 10
    a_prompt_tokens: int = 256
    a_output_tokens: int = 128
    mesh: MeshSimConfig = MeshSimConfig(num_executors=2, num_blocks=256)

    @property
    def a_clients(self) -> int:
        """Closed-loop clients of A: ``a_overload`` × the requests its quota admits at once."""
        per_request = math.ceil((self.a_prompt_tokens + 1) / self.mesh.block_size)
        return self.a_overload * max(1, self.a_quota_blocks // per_request)


def b_jobs(cfg: IsolationSimConfig) -> list[Job]:
    """Tenant B's open-loop requests (seeded)."""
    rng = random.Random(cfg.seed)
    jobs, t = [], 0.0
    for _ in range(cfg.num_b_requests):
        t += rng.expovariate(cfg.b_rate)
        prompt = max(1, round(cfg.prompt_median * math.exp(rng.gauss(0, 0.5))))
        output = max(1, round(cfg.output_median * math.exp(rng.gauss(0, 0.5))))
        jobs.append(Job("B", prompt, output, [], arrival=t))
    return jobs


def a_jobs(cfg: IsolationSimConfig, span_s: float) -> list[Job]:
    """Tenant A's closed-loop requests: enough for every client to stay busy for ``span_s``
    (one request per client per ``a_output_tokens`` × 10 ms step, the fastest possible)."""
    per_client = math.ceil(span_s / (cfg.a_output_tokens * cfg.mesh.step_base_s)) + 1
    return [Job("A", cfg.a_prompt_tokens, cfg.a_output_tokens, [], client=c)
            for c in range(cfg.a_clients) for _ in range(per_client)]


def _b_ttft(cfg: IsolationSimConfig, jobs: list[Job], quotas: dict[str, int]) -> tuple[list[float], float]:
    reqs, _, _ = simulate(replace(cfg.mesh, tenant_quotas=quotas), jobs, until_open_loop_done=True)
    b = [r for r in reqs if r is not None and r.tenant == "B"]
    return [r.first_token - r.arrival for r in b], max(r.finished for r in b)


def run(cfg: IsolationSimConfig) -> dict:
    """The three runs and the report (see the module docstring)."""
    b = b_jobs(cfg)
    alone, b_end = _b_ttft(cfg, b, {})
    a = a_jobs(cfg, b_end)
    shared, _ = _b_ttft(cfg, b + a, {"A": cfg.a_quota_blocks})
    unquoted, _ = _b_ttft(cfg, b + a, {})
    p99 = {name: percentile(v, 99, "nearest-rank")
           for name, v in (("alone", alone), ("shared", shared), ("unquoted", unquoted))}
    return {
        "workload": "quota-isolation", "seed": cfg.seed, "a_clients": cfg.a_clients,
        "b_ttft_p50_s": percentile(shared, 50, "nearest-rank"), "b_ttft_p99_s": p99["shared"],
        "b_alone_ttft_p50_s": percentile(alone, 50, "nearest-rank"), "b_alone_ttft_p99_s": p99["alone"],
        "b_without_quota_ttft_p99_s": p99["unquoted"],
        "b_p99_ratio": p99["shared"] / p99["alone"],
        "b_p99_ratio_without_quota": p99["unquoted"] / p99["alone"],
        "config": {**asdict(cfg), "mesh": {**asdict(cfg.mesh), "tenant_quotas": {}}},
    }
