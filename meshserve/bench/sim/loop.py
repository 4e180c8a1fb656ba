"""A discrete-event simulator of the mesh with prefix caches, tenants and TTFT.

Like ``meshserve.bench.sim.heavy_tail`` it drives the real ``AdmissionCore`` (queue policy,
quotas, pools, prefix index, routing cost) with a simulated clock; its
executors (``CachedExecutor``) extend ``meshserve.bench.sim.heavy_tail.SimExecutor``'s
continuous-batching model with what routing and quotas need:

* a **prefix cache**: an LRU of at most ``prefix_cache_blocks`` chain hashes
  (``meshserve.block_hash.routing_block_hashes``: the gateway's real hashes).
  When a request enters the running batch, its leading cached blocks are a hit
  (at most ``prompt - 1`` tokens; they are touched) and it prefills only the
  rest; when its prefill completes its full prompt blocks enter the cache (most
  recent first out last), evicting the least recently used. Stored and evicted
  hashes go to the scheduler at once (``AdmissionCore.on_kv_events``), as an
  executor's ``KvEvents`` would.
* **reports** after every change: free blocks, leases and the blocks each
  lease holds (``AdmissionCore.on_capacity``, quota correction included).
* **times**: TTFT is arrival → the step that samples the first token; an
  executor's busy time is the sum of its step durations.

Jobs arrive open-loop (a fixed arrival time) or closed-loop (a client sends its
next job when the previous one finishes). Workloads and their reports live in
``meshserve.bench.sim.prefix_routing`` (prefix routing) and ``meshserve.bench.sim.quota_isolation``
(tenant quotas).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

from meshserve.bench.sim.heavy_tail import SimConfig, SimExecutor, SimRequest
from scheduler.admission import AdmissionCore, AdmissionRequest, SchedulerConfig
from scheduler.registry import ExecutorState
from scheduler.routing import RoutingConfig

MODEL = "sim"


@dataclass(frozen=True)
class MeshSimConfig:
    """Executors and scheduler of a mesh simulation (times in seconds).

    Attributes:
        num_executors: modelled executors.
        num_blocks: KV blocks of each.
        block_size: tokens per block (the gateway hashes with it too).
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most requests at an executor (running + waiting).
        step_base_s: fixed time of a step.
        step_per_token_s: time per token in a step.
        prefix_cache_blocks: LRU capacity of each executor's prefix cache (blocks).
        queue_policy: the admission queue's policy.
        max_queue_wait_s: its aging bound (sjf).
        routing: ``prefix`` or ``least-loaded``.
        tenant_quotas: tenant → KV quota (blocks).
    """

    num_executors: int = 4
    num_blocks: int = 1024
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    step_base_s: float = 0.01
    step_per_token_s: float = 0.0001
    prefix_cache_blocks: int = 160
    queue_policy: str = "fcfs"
    max_queue_wait_s: float = 30.0
    routing: str = "prefix"
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)

    def executor_model(self) -> SimConfig:
        return SimConfig(num_blocks=self.num_blocks, block_size=self.block_size,
                         max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                         step_base_s=self.step_base_s, step_per_token_s=self.step_per_token_s)


@dataclass
class Job:
    """One request of a workload.

    Attributes:
        tenant: who sends it.
        prompt_len: prompt tokens.
        output: output tokens it generates.
        block_hashes: the prompt's chain hashes (routing chain, 16 bytes each).
        arrival: open-loop arrival time (seconds), or None for a closed-loop job.
        client: closed-loop client id (its jobs run one after another), or None.
        group: a label the report groups by (e.g. the system prompt's index).
        priority: priority class.
    """

    tenant: str
    prompt_len: int
    output: int
    block_hashes: list[bytes]
    arrival: float | None = None
    client: int | None = None
    group: int = 0
    priority: int = 0


@dataclass
class MeshRequest(SimRequest):
    """A ``SimRequest`` with its hashes, its prefix hit and its first-token time."""

    job: Job | None = None
    executor_id: str = ""
    hit_tokens: int | None = None
    first_token: float | None = None


class CachedExecutor(SimExecutor):
    """``SimExecutor`` with an LRU prefix cache and busy time (see the module docstring)."""

    def __init__(self, eid: str, cfg: MeshSimConfig, core: AdmissionCore):
        super().__init__(eid, cfg.executor_model())
        self.mesh = cfg
        self.core = core
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self.busy_s = 0.0

    def admit_waiting(self) -> None:
        super().admit_waiting()
        for r in self.running:
            if r.hit_tokens is None:
                self._look_up(r)

    def _look_up(self, r: MeshRequest) -> None:
        hit = 0
        for h in r.job.block_hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += 1
        r.hit_tokens = min(hit * self.mesh.block_size, r.prompt - 1)
        r.computed = max(r.computed, r.hit_tokens)

    def on_prefilled(self, r: MeshRequest) -> None:
        """Caches the request's full prompt blocks; tells the scheduler what changed."""
        stored, removed = [], []
        for h in r.job.block_hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.mesh.prefix_cache_blocks:
            h, _ = self.cache.popitem(last=False)
            removed.append(h)
        stored = [h for h in stored if h in self.cache]
        self.core.on_kv_events(self.eid, stored, removed)


def _request(rid: int, job: Job, arrival: float) -> MeshRequest:
    return MeshRequest(rid, job.tenant, arrival, job.prompt_len, job.output, job=job)


def simulate(cfg: MeshSimConfig, jobs: list[Job], until_open_loop_done: bool = False
             ) -> tuple[list[MeshRequest | None], dict[str, CachedExecutor], AdmissionCore]:
    """Runs ``jobs``; returns the requests (in job order; None: never sent), the executors
    and the core. It runs to completion, or with ``until_open_loop_done`` until every
    open-loop job has finished (closed-loop clients are then background load)."""
    clock = [0.0]
    core = AdmissionCore(SchedulerConfig(queue_policy=cfg.queue_policy, max_queue_wait_s=cfg.max_queue_wait_s,
                                         max_queue_len=10 ** 9,
                                         tenant_quotas=dict(cfg.tenant_quotas), routing=RoutingConfig(cfg.routing)),
                         clock=lambda: clock[0])
    executors = {f"e{i}": CachedExecutor(f"e{i}", cfg, core) for i in range(cfg.num_executors)}
    for e in executors.values():
        core.registry.add(ExecutorState(e.eid, e.eid, MODEL, cfg.num_blocks, cfg.block_size, 10 ** 9))
    reqs: list[MeshRequest | None] = [None] * len(jobs)
    backlog: dict[int, list[int]] = {}  # closed-loop client → its next job indices
    events: list[tuple[float, int, int, str]] = []
    for i, job in enumerate(jobs):
        if job.client is None:
            events.append((job.arrival or 0.0, 1, i, ""))
        else:
            backlog.setdefault(job.client, []).append(i)
    for queue in backlog.values():
        events.append((0.0, 1, queue.pop(0), ""))
    heapq.heapify(events)
    seq = len(jobs)
    open_left = sum(job.client is None for job in jobs)

    def report(e: CachedExecutor) -> None:
        held = {r.lease_id: e.blocks(r) for r in e.running}
        leases = [r.lease_id for r in e.running + e.waiting]
        core.on_capacity(e.eid, e.free_blocks(), len(e.running), len(e.waiting), leases, held)

    def dispatch_and_start() -> None:
        nonlocal seq
        for areq, lease in core.dispatch():
            r = reqs[int(areq.request_id)]
            r.assigned, r.lease_id, r.executor_id = clock[0], lease.lease_id, lease.executor_id
            e = executors[lease.executor_id]
            e.waiting.append(r)
            e.admit_waiting()
            report(e)
        for e in executors.values():
            if not e.busy and e.running:
                e.busy = True
                seq += 1
                duration = e.step()
                e.busy_s += duration
                heapq.heappush(events, (clock[0] + duration, 0, seq, e.eid))

    while events:
        clock[0], kind, key, eid = heapq.heappop(events)
        if kind == 1:
            job = jobs[key]
            r = reqs[key] = _request(key, job, clock[0])
            core.submit(AdmissionRequest(str(key), job.tenant, job.priority, job.prompt_len, 10 ** 6, MODEL,
                                         arrival=clock[0], block_hashes=tuple(job.block_hashes),
                                         hash_block_size=cfg.block_size))
        else:
            e = executors[eid]
            e.busy = False
            prefilling = [r for r in e.running if r.generated == 0]
            done = e.finish_step()
            for r in prefilling:  # (one may have been preempted right after its first token)
                if r.generated > 0 and r.first_token is None:
                    r.first_token = clock[0]
                    e.on_prefilled(r)
            for r in done:
                r.finished = clock[0]
                open_left -= r.job.client is None
                core.release(r.lease_id, r.generated)
                client = r.job.client
                if client is not None and backlog.get(client):
                    heapq.heappush(events, (clock[0], 1, backlog[client].pop(0), ""))
            e.admit_waiting()
            report(e)
            if until_open_loop_done and open_left == 0:
                break
        dispatch_and_start()
    return reqs, executors, core


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in (0, 1])."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
