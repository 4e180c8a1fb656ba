"""A discrete-event simulator of the mesh's admission, on the scheduler's own core.

The simulator drives the real ``AdmissionCore`` (queue policy, predictor, quotas)
with a simulated clock, against ``num_executors`` modelled executors:

* **Executor model** (continuous batching, as ``executor/engine``): every step
  runs one decode token of each running request whose prompt is done, then
  prompt chunks within ``max_num_batched_tokens``; a step lasts
  ``step_base_s + step_per_token_s * tokens_in_step`` seconds. The prompt's last
  chunk also yields the first output token. A request holds
  ``ceil((prompt + generated + 1) / block_size)`` of the executor's
  ``num_blocks`` KV blocks; when a growing request finds none free, the latest
  admitted running request is preempted (recompute: it waits at the executor and
  prefills prompt + generated again). The executor reports as free the blocks
  neither its running nor its waiting requests hold (0 when ``max_num_seqs``
  requests are there), so the queue forms at the scheduler; it reports and
  acknowledges its leases after every change; a finished request releases its
  lease with its completion tokens (so the predictor learns online).
* **Workload ``heavy-tail``**: ``num_tenants`` tenants; tenant k's median output
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

import heapq
import math
import random
from dataclasses import asdict, dataclass, field

from scheduler.admission import AdmissionCore, AdmissionRequest, SchedulerConfig
from scheduler.registry import ExecutorState

MODEL = "sim"


@dataclass(frozen=True)
class SimConfig:
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


@dataclass
class SimRequest:
    rid: int
    tenant: str
    arrival: float
    prompt: int
    output: int
    assigned: float | None = None
    finished: float | None = None
    lease_id: str = ""
    generated: int = 0
    computed: int = 0  # prompt (+ recomputed output) tokens prefilled

    @property
    def target(self) -> int:
        """Tokens to prefill before the next decode: the prompt plus what was generated (recompute)."""
        return self.prompt + self.generated


def workload(cfg: SimConfig) -> list[tuple[str, int, int]]:
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


@dataclass
class SimExecutor:
    """One modelled executor: running requests, its local waiting list, KV blocks."""

    eid: str
    cfg: SimConfig
    running: list[SimRequest] = field(default_factory=list)
    waiting: list[SimRequest] = field(default_factory=list)
    busy: bool = False
    wasted_tokens: int = 0  # tokens computed, then lost to a preemption (recomputed later)

    def blocks(self, r: SimRequest) -> int:
        return math.ceil((max(r.computed, r.target) + 1) / self.cfg.block_size)

    def used(self) -> int:
        return sum(self.blocks(r) for r in self.running)

    def free_blocks(self) -> int:
        """What it reports: blocks not held by running or waiting requests; 0 with no sequence slot left."""
        if len(self.running) + len(self.waiting) >= self.cfg.max_num_seqs:
            return 0
        return max(0, self.cfg.num_blocks - self.used() - sum(self.blocks(r) for r in self.waiting))

    def admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            if self.used() + self.blocks(self.waiting[0]) > self.cfg.num_blocks and self.running:
                break
            self.running.append(self.waiting.pop(0))

    def step(self) -> float:
        """Plans one step (progress applied by ``finish_step``); returns its duration (s)."""
        budget = self.cfg.max_num_batched_tokens
        self._plan = []
        for r in self.running:
            if r.computed >= r.target:
                self._plan.append((r, 1))
                budget -= 1
        for r in self.running:
            if r.computed < r.target and budget > 0:
                chunk = min(budget, r.target - r.computed)
                self._plan.append((r, chunk))
                budget -= chunk
        tokens = sum(n for _, n in self._plan)
        return self.cfg.step_base_s + self.cfg.step_per_token_s * tokens

    def finish_step(self) -> list[SimRequest]:
        """Applies the planned step; returns the requests that finished."""
        done = []
        for r, n in self._plan:
            if r not in self.running:
                continue
            if r.computed >= r.target:
                r.generated += 1
                r.computed += 1
            else:
                r.computed += n
                if r.computed >= r.target:
                    r.generated += 1  # the last prompt chunk samples a token
                    r.computed = r.target
            if r.generated >= r.output:
                done.append(r)
        for r in done:
            self.running.remove(r)
        while self.used() > self.cfg.num_blocks and len(self.running) > 1:
            victim = self.running.pop()  # latest admitted: preempted, recomputed later
            self.wasted_tokens += victim.computed
            victim.computed = 0
            self.waiting.insert(0, victim)
        return done


def simulate(cfg: SimConfig, arrivals: list[float] | None = None,
             steps: list[tuple[float, int]] | None = None) -> tuple[list[SimRequest], AdmissionCore]:
    """Runs the workload; ``arrivals`` (seconds) overrides the Poisson arrivals; ``steps``
    collects (end time, useful tokens) of every executor step: its tokens less those a
    preemption in it threw away (they are computed again later)."""
    jobs = workload(cfg)
    if arrivals is None:
        rng = random.Random(cfg.seed + 1)
        rate = cfg.load * saturated_throughput(cfg)
        t, arrivals = 0.0, []
        for _ in jobs:
            t += rng.expovariate(rate)
            arrivals.append(t)
    clock = [0.0]
    core = AdmissionCore(SchedulerConfig(queue_policy=cfg.policy, max_queue_wait_s=cfg.max_queue_wait_s,
                                         max_queue_len=10 ** 9, kv_reservation=cfg.kv_reservation),
                         clock=lambda: clock[0])
    executors = {f"e{i}": SimExecutor(f"e{i}", cfg) for i in range(cfg.num_executors)}
    for e in executors.values():
        core.registry.add(ExecutorState(e.eid, e.eid, MODEL, cfg.num_blocks, cfg.block_size, 10 ** 9))
    reqs = [SimRequest(i, ten, a, p, o) for i, ((ten, p, o), a) in enumerate(zip(jobs, arrivals))]
    events: list[tuple[float, int, int, str]] = [(r.arrival, 1, r.rid, "") for r in reqs]
    heapq.heapify(events)
    seq = len(reqs)

    def report(e: SimExecutor) -> None:
        leases = [r.lease_id for r in e.running + e.waiting]
        core.on_capacity(e.eid, e.free_blocks(), len(e.running), len(e.waiting), leases,
                         {r.lease_id: e.blocks(r) for r in e.running})

    def dispatch_and_start() -> None:
        nonlocal seq
        for areq, lease in core.dispatch():
            r = reqs[int(areq.request_id)]
            r.assigned, r.lease_id = clock[0], lease.lease_id
            e = executors[lease.executor_id]
            e.waiting.append(r)
            e.admit_waiting()
            report(e)
        for e in executors.values():
            if not e.busy and e.running:
                e.busy = True
                seq += 1
                heapq.heappush(events, (clock[0] + e.step(), 0, seq, e.eid))

    while events:
        clock[0], kind, key, eid = heapq.heappop(events)
        if kind == 1:
            r = reqs[key]
            core.submit(AdmissionRequest(str(r.rid), r.tenant, 0, r.prompt, cfg.max_tokens, MODEL, arrival=r.arrival))
        else:
            e = executors[eid]
            e.busy = False
            wasted = e.wasted_tokens
            done = e.finish_step()
            if steps is not None:
                steps.append((clock[0], sum(n for _, n in e._plan) - (e.wasted_tokens - wasted)))
            for r in done:
                r.finished = clock[0]
                core.release(r.lease_id, r.generated)
            e.admit_waiting()
            report(e)
        dispatch_and_start()
    return reqs, core


def saturated_throughput(cfg: SimConfig) -> float:
    """Requests per second at saturation: the useful token rate (prompt + output tokens processed
    per second, all executors, less the tokens preemptions threw away and had recomputed) of a
    run where every request arrives at t = 0 (FCFS), measured until 60 % of them finished (the
    drain at the end would understate it), divided by the mean tokens of a request.

    Counting recomputed tokens as work would overstate capacity by the preemption waste, and
    "90 % load" would be an overload whose queue (and every policy's max wait) grows without
    bound over the run."""
    steps: list[tuple[float, int]] = []
    reqs, _ = simulate(SimConfig(**{**asdict(cfg), "policy": "fcfs"}), arrivals=[0.0] * cfg.num_requests,
                       steps=steps)
    until = sorted(r.finished for r in reqs)[(6 * len(reqs)) // 10]
    token_rate = sum(n for t, n in steps if t <= until) / until
    return token_rate / (sum(r.prompt + r.output for r in reqs) / len(reqs))


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def run(cfg: SimConfig) -> dict:
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
        "short_half_p99_latency_s": _p(short, 0.99),
        "long_half_mean_latency_s": sum(long) / len(long),
        "long_half_p99_latency_s": _p(long, 0.99),
        "mean_latency_s": sum(short + long) / len(reqs),
        "max_wait_s": max(r.assigned - r.arrival for r in reqs),
        "aging_bound_s": cfg.max_queue_wait_s,
        "output_len_log_sigma": math.sqrt(sum((x - mean_log) ** 2 for x in logs) / len(logs)),
        "throughput_requests_per_s": len(reqs) / span,
        "predictor": core.predictor.stats(),
        "config": asdict(cfg),
    }
