"""The one event loop of every simulation: the mesh's admission on the scheduler's own core.

``simulate`` drives the real ``AdmissionCore`` (queue policy, predictor, quotas,
pools, prefix index, routing cost) with a simulated clock, against
``num_executors`` modelled executors (``SimExecutor``):

* **continuous batching** (as ``executor/engine``): every step runs one decode
  token of each running request whose prompt is done, then prompt chunks within
  ``max_num_batched_tokens``; a step lasts ``step_base_s + step_per_token_s *
  tokens_in_step`` seconds. The prompt's last chunk also yields the first output
  token. A request holds ``ceil((prompt + generated + 1) / block_size)`` of the
  executor's ``num_blocks`` KV blocks; when a growing request finds none free, the
  latest admitted running request is preempted (recompute: it waits at the
  executor and prefills prompt + generated again).
* a **prefix cache**: an LRU of at most ``prefix_cache_blocks`` chain hashes
  (``meshserve.block_hash.routing_block_hashes``: the gateway's real hashes).
  When a request enters the running batch, its leading cached blocks are a hit
  (at most ``prompt - 1`` tokens; they are touched) and it prefills only the
  rest; when its prefill completes its full prompt blocks enter the cache (most
  recent first out last), evicting the least recently used. Stored and evicted
  hashes go to the scheduler at once (``AdmissionCore.on_kv_events``), as an
  executor's ``KvEvents`` would. A job without hashes never hits.
* **reports** after every change: as free the blocks neither its running nor
  its waiting requests hold (0 when ``max_num_seqs`` requests are there, so the
  queue forms at the scheduler), its leases and the blocks each holds
  (``AdmissionCore.on_capacity``, quota correction included); a finished request
  releases its lease with its completion tokens (so the predictor learns online).
* **times**: TTFT is arrival → the step that samples the first token; an
  executor's busy time is the sum of its step durations.

* an optional **autoscaler** (``Scaler``): every ``tick_s`` it names the
  executor count it wants; a new executor registers ``cold_start_s`` after it
  was asked for (counted from then in ``Fleet``); a surplus one is cancelled if
  still starting, else drained (``AdmissionCore.drain_executor``: nothing new is
  routed to it) and removed once it holds no request. The scaler learns every
  admitted request's cost and every finished request's tokens.

Jobs arrive open-loop (a fixed arrival time) or closed-loop (a client sends its
next job when the previous one finishes). The workloads and their reports are
the sibling modules: ``heavy_tail`` (queue policies), ``prefix_routing``,
``quota_isolation`` and ``autoscaling``.

This file is a little over 400 lines because it is the one event loop of every
simulator (STYLE: one of each helper): the autoscaler's events share its heap
and its executors, so they live in it rather than in a second loop.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.registry import ExecutorState
from scheduler.routing import RoutingConfig

MODEL = "sim"


@dataclass(frozen=True)
class MeshSimConfig:
    """Executors and scheduler of a simulation (times in seconds).

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
        kv_reservation: ``prompt`` or ``predicted``: the scheduler's room check.
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
    kv_reservation: str = "prompt"


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
        max_tokens: the request's ``max_tokens`` (what the scheduler sees of its output).
    """

    tenant: str
    prompt_len: int
    output: int
    block_hashes: list[bytes]
    arrival: float | None = None
    client: int | None = None
    group: int = 0
    priority: int = 0
    max_tokens: int = 10 ** 6


@dataclass
class SimRequest:
    """A job once sent: its progress at the executor and its times (seconds)."""

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
    job: Job | None = None
    executor_id: str = ""
    hit_tokens: int | None = None
    first_token: float | None = None

    @property
    def target(self) -> int:
        """Tokens to prefill before the next decode: the prompt plus what was generated (recompute)."""
        return self.prompt + self.generated


class SimExecutor:
    """One modelled executor: running requests, its local waiting list, KV blocks and
    prefix cache, busy time (see the module docstring)."""

    def __init__(self, eid: str, cfg: MeshSimConfig, core: AdmissionCore):
        self.eid = eid
        self.cfg = cfg
        self.core = core
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.busy = False
        self.wasted_tokens = 0  # tokens computed, then lost to a preemption (recomputed later)
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self.busy_s = 0.0
        self._plan: list[tuple[SimRequest, int]] = []

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
        for r in self.running:
            if r.hit_tokens is None:
                self._look_up(r)

    def _look_up(self, r: SimRequest) -> None:
        hit = 0
        for h in r.job.block_hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += 1
        r.hit_tokens = min(hit * self.cfg.block_size, r.prompt - 1)
        r.computed = max(r.computed, r.hit_tokens)

    def on_prefilled(self, r: SimRequest) -> None:
        """Caches the request's full prompt blocks; tells the scheduler what changed."""
        stored, removed = [], []
        for h in r.job.block_hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.cfg.prefix_cache_blocks:
            h, _ = self.cache.popitem(last=False)
            removed.append(h)
        stored = [h for h in stored if h in self.cache]
        self.core.on_kv_events(self.eid, stored, removed)

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


class Scaler(Protocol):
    """An autoscaler the loop consults (``meshserve.bench.sim.autoscaling``)."""

    tick_s: float  # seconds between two ``target`` calls
    cold_start_s: float  # seconds from asking for an executor to its registration

    def on_arrival(self, now: float, num_tokens: int) -> None: ...

    def on_served(self, now: float, num_tokens: int) -> None: ...

    def target(self, now: float, num_ready: int, num_queued: int, queued_tokens: int) -> int: ...


@dataclass
class Fleet:
    """Executor lifetimes under a ``Scaler`` (seconds): eid → [asked, ready or None, gone or None];
    ``initial``: the executors there from the start (no cold start)."""

    lives: dict[str, list[float | None]] = field(default_factory=dict)
    initial: set[str] = field(default_factory=set)

    def executor_seconds(self, start: float, end: float) -> float:
        """Executor-seconds (starting, ready or draining) within [start, end)."""
        return sum(max(0.0, min(end, gone if gone is not None else end) - max(start, asked))
                   for asked, _ready, gone in self.lives.values())

    def cold_starts(self, start: float, end: float) -> int:
        """Executors the scaler asked for within [start, end)."""
        return sum(start <= life[0] < end for eid, life in self.lives.items() if eid not in self.initial)


def _request(rid: int, job: Job, arrival: float) -> SimRequest:
    return SimRequest(rid, job.tenant, arrival, job.prompt_len, job.output, job=job)


def simulate(cfg: MeshSimConfig, jobs: list[Job], until_open_loop_done: bool = False,
             steps: list[tuple[float, int]] | None = None, scaler: Scaler | None = None,
             fleet: Fleet | None = None,
             ) -> tuple[list[SimRequest | None], dict[str, SimExecutor], AdmissionCore]:
    """Runs ``jobs``; returns the requests (in job order; None: never sent), the executors
    and the core. It runs to completion, or with ``until_open_loop_done`` until every
    open-loop job has finished (closed-loop clients are then background load).
    ``steps`` collects (end time, useful tokens) of every executor step: its tokens less
    those a preemption in it threw away (they are computed again later). With a
    ``scaler`` the ``cfg.num_executors`` executors are the start and it adds and drains
    executors (module docstring); ``fleet`` collects their lifetimes."""
    clock = [0.0]
    core = AdmissionCore(SchedulerConfig(queue_policy=cfg.queue_policy, max_queue_wait_s=cfg.max_queue_wait_s,
                                         max_queue_len=10 ** 9, tenant_quotas=dict(cfg.tenant_quotas),
                                         routing=RoutingConfig(cfg.routing), kv_reservation=cfg.kv_reservation),
                         clock=lambda: clock[0])
    executors = {f"e{i}": SimExecutor(f"e{i}", cfg, core) for i in range(cfg.num_executors)}
    for e in executors.values():
        core.registry.add(ExecutorState(e.eid, e.eid, MODEL, cfg.num_blocks, cfg.block_size, 10 ** 9))
    fleet = fleet if fleet is not None else Fleet()
    fleet.lives.update({eid: [0.0, 0.0, None] for eid in executors})
    fleet.initial.update(executors)
    starting: list[str] = []  # asked for, not registered yet (oldest first)
    reqs: list[SimRequest | None] = [None] * len(jobs)
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
    arrivals_left = len(events)
    if scaler is not None:
        heapq.heappush(events, (scaler.tick_s, 2, -1, ""))

    def scale() -> None:
        nonlocal seq
        ready = [e for e in executors if not core.registry.get(e).draining]
        queued = core.queued()
        want = scaler.target(clock[0], len(ready), len(queued), sum(r.queued_tokens for r in queued))
        for _ in range(want - len(ready) - len(starting)):
            eid = f"e{len(fleet.lives)}"
            fleet.lives[eid] = [clock[0], None, None]
            starting.append(eid)
            seq += 1
            heapq.heappush(events, (clock[0] + scaler.cold_start_s, 3, seq, eid))
        surplus = len(ready) + len(starting) - want
        while surplus > 0 and starting:  # a starting executor goes first
            fleet.lives[starting.pop()][2] = clock[0]
            surplus -= 1
        for eid in sorted(ready, key=lambda x: len(executors[x].running) + len(executors[x].waiting))[:surplus]:
            core.drain_executor(eid)
            leave_if_idle(executors[eid])

    def leave_if_idle(e: SimExecutor) -> None:
        state = core.registry.get(e.eid)
        if state is not None and state.draining and not state.leases and not e.running and not e.waiting:
            core.remove_executor(e.eid)
            del executors[e.eid]
            fleet.lives[e.eid][2] = clock[0]

    def report(e: SimExecutor) -> None:
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
        if kind == 2:
            scale()
            if arrivals_left or open_left:
                heapq.heappush(events, (clock[0] + scaler.tick_s, 2, -1, ""))
        elif kind == 3:
            if eid in starting:  # (not cancelled meanwhile)
                starting.remove(eid)
                fleet.lives[eid][1] = clock[0]
                executors[eid] = SimExecutor(eid, cfg, core)
                core.registry.add(ExecutorState(eid, eid, MODEL, cfg.num_blocks, cfg.block_size, 10 ** 9))
        elif kind == 1:
            job = jobs[key]
            arrivals_left -= job.client is None
            reqs[key] = _request(key, job, clock[0])
            areq = AdmissionRequest(str(key), job.tenant, job.priority, job.prompt_len, job.max_tokens, MODEL,
                                    arrival=clock[0], block_hashes=tuple(job.block_hashes),
                                    hash_block_size=cfg.block_size)
            core.submit(areq)
            if scaler is not None:
                scaler.on_arrival(clock[0], int(areq.cost))
        else:
            e = executors[eid]
            e.busy = False
            prefilling = [r for r in e.running if r.generated == 0]
            wasted = e.wasted_tokens
            done = e.finish_step()
            if steps is not None:
                steps.append((clock[0], sum(n for _, n in e._plan) - (e.wasted_tokens - wasted)))
            for r in prefilling:  # (one may have been preempted right after its first token)
                if r.generated > 0 and r.first_token is None:
                    r.first_token = clock[0]
                    e.on_prefilled(r)
            for r in done:
                r.finished = clock[0]
                open_left -= r.job.client is None
                core.release(r.lease_id, r.generated)
                if scaler is not None:
                    scaler.on_served(clock[0], r.prompt + r.generated)
                client = r.job.client
                if client is not None and backlog.get(client):
                    heapq.heappush(events, (clock[0], 1, backlog[client].pop(0), ""))
            e.admit_waiting()
            report(e)
            leave_if_idle(e)
            if until_open_loop_done and open_left == 0:
                break
        dispatch_and_start()
    return reqs, executors, core
