"""Scheduler policies on the real mesh: ``python -m meshserve.bench.policies``.

(About 400 lines: the two experiments share the mesh start-up, the client loop and the
report; their pure parts already live in ``policy_workload``.)

Two experiments, each on a mesh of real processes started with
``meshserve.cli.launcher.Mesh`` (scheduler, 2 executors, gateway on loopback),
driven by concurrent gRPC clients (``meshserve.client``). Every request sets
``ignore_eos``, temperature 0 and ``max_tokens`` = its drawn output length, so
it produces exactly that many tokens (checked).

* ``sjf-vs-fcfs``: a heavy-tailed open-loop burst (output lengths log-normal,
  ``--output-sigma`` ≥ 1, Poisson arrivals at ``--rate``, above the mesh's
  service rate) against a scheduler with ``--queue-policy fcfs`` and one with
  ``sjf`` (``--max-queue-wait-s`` = ``--aging-bound-s``); the arms alternate
  (``fcfs, sjf`` then ``sjf, fcfs`` …, one fresh mesh per arm, since the policy
  is a scheduler flag). The executors get a small KV cache
  (``--kv-cache-memory``), so only a few requests fit at once and the queue
  forms at the scheduler, where the policy acts. Per arm: latency (client send
  → last token) of the shortest and the longest half of the requests by true
  size (prompt + output tokens), and the waits (the gateway's ``queue_s``:
  arrival → assignment); then the SJF / FCFS ratios.
* ``quota-isolation``: one mesh with a tenants file: tenant ``a`` (key
  ``key-a``, ``kv_quota_blocks`` = ``--quota-blocks``) and ``b`` (``key-b``, no
  quota). Tenant B sends an open-loop Poisson stream; in the ``a+b`` arm tenant
  A also runs closed-loop clients, as many as keep 10 × its quota of KV blocks
  in demand (``--a-demand-factor``). Arms alternate on the same mesh
  (``b-alone``, ``a+b``, then ``a+b``, ``b-alone`` …). Per arm: B's TTFT (client
  send → first token) p50/p99, and A's calls, refusals (RESOURCE_EXHAUSTED) and
  queued calls (at least one queue update).

The workload, outcomes and statistics are ``meshserve.bench.policy_workload`` (pure,
unit-tested); the runs print numbers and write a JSON report, they assert nothing
about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from meshserve.bench.policy_workload import (TENANT_KEYS, Job, JobSpec, Outcome, a_clients, arm_order, call_counts,
                                             latency_stats, log_sigma, make_jobs, ratio, tenants_toml, ttft_stats)
from meshserve.bench.workload import model_vocabulary
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.client import build_request, channel, generate_choices
from meshserve.model_files import resolve_model
from meshserve.v1 import gateway_pb2_grpc

log = logging.getLogger(__name__)

EXPERIMENTS = ("sjf-vs-fcfs", "quota-isolation")
@dataclass
class Options:
    """Command-line options (see ``main``)."""

    experiment: str
    seed: int = 0
    report_json: str | None = None
    rounds: int = 1
    executors: int = 2
    model: str = "default"
    dtype: str = "float32"
    kv_cache_memory: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    kv_reservation: str = "predicted"
    # sjf-vs-fcfs
    num_requests: int = 60
    rate: float = 8.0
    output_median: int = 12
    output_sigma: float = 1.2
    output_max: int = 64
    prompt_median: int = 48
    aging_bound_s: float = 20.0
    # quota-isolation
    b_requests: int = 40
    b_rate: float = 2.0
    b_output_len: int = 16
    quota_blocks: int = 8
    a_demand_factor: float = 10.0
    a_prompt_len: int = 48
    a_output_len: int = 32
    log_dir: str | None = None
    extra: dict = field(default_factory=dict)


async def _call(stub, job: Job, sent_at: float | None = None) -> Outcome:
    request = build_request(list(job.prompt_token_ids), max_tokens=job.output_len, temperature=0.0,
                            ignore_eos=True, request_id=job.request_id)
    metadata = (("x-api-key", TENANT_KEYS[job.tenant]),) if job.tenant in TENANT_KEYS else ()
    sent = time.monotonic() if sent_at is None else sent_at
    try:
        choices = await generate_choices(stub, request, metadata=metadata, timeout=600.0)
    except grpc.aio.AioRpcError as exc:
        return Outcome(job, sent, time.monotonic(), error=exc.code().name)
    c = choices[0]
    out = Outcome(job, sent, c.token_times[-1] if c.token_times else time.monotonic(),
                  ttft_s=(c.token_times[0] - sent) if c.token_times else None,
                  queue_s=c.timings.get("queue_s"), num_tokens=len(c.token_ids), queue_updates=c.queue_updates)
    if out.num_tokens != job.output_len:
        out.error = "TOKEN_COUNT"
    return out


async def run_open_loop(stub, jobs: list[Job]) -> list[Outcome]:
    """Sends each job at its ``arrival_s`` after now (all concurrently); waits for all."""
    start = time.monotonic()

    async def one(job: Job) -> Outcome:
        await asyncio.sleep(max(0.0, start + job.arrival_s - time.monotonic()))
        return await _call(stub, job)

    return list(await asyncio.gather(*(one(j) for j in jobs)))


async def run_closed_loop(stub, clients: int, make_job, stop: asyncio.Event) -> list[Outcome]:
    """``clients`` loops, each sending ``make_job(client, k)`` back to back until ``stop``;
    a refused call is retried after 0.2 s (it still counts). At ``stop`` the calls still
    in flight are cancelled and not counted (their number is logged)."""
    outcomes: list[Outcome] = []

    async def loop(c: int) -> None:
        k = 0
        while True:
            o = await _call(stub, make_job(c, k))
            outcomes.append(o)
            k += 1
            if o.error:
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(loop(c)) for c in range(clients)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    log.info("closed loop stopped: %d calls done; each of the %d clients' current call cancelled",
             len(outcomes), clients)
    return outcomes


async def _warm_up(stub, vocab: int, specials: frozenset[int], executors: int, tenant: str = "default") -> None:
    """A few short calls so every executor has run its code paths once (not measured)."""
    jobs = make_jobs(JobSpec(num_requests=2 * executors, prompt_median=32, prompt_range=(16, 64), output_median=4,
                             output_sigma=0.0, output_range=(4, 4), rate=100.0), 10_000, vocab, specials,
                     tenant=tenant, prefix="warmup")
    outs = await asyncio.gather(*(_call(stub, j) for j in jobs))
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad}")


class _MeshRun:
    """One launched mesh and a gateway stub (async context manager)."""

    def __init__(self, opts: Options, executor_args: list[str], scheduler_args: list[str],
                 tenants_file: str | None, name: str):
        base = Path(opts.log_dir) if opts.log_dir else Path(tempfile.mkdtemp(prefix="meshserve-policies-"))
        self.log_dir = base / name
        self.config = MeshConfig(port=0, executors=opts.executors, model=opts.model,
                                 executor_args=executor_args, tenants_file=tenants_file,
                                 scheduler_args=scheduler_args, log_dir=self.log_dir)
        self.mesh = None
        self.channel = None
        self.stub = None

    async def __aenter__(self):
        self.mesh = Mesh(self.config)
        t0 = time.monotonic()
        await self.mesh.start()
        log.info("mesh up in %.1f s (logs: %s)", time.monotonic() - t0, self.log_dir)
        self.channel = channel(self.mesh.gateway_address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        if self.channel is not None:
            await self.channel.close()
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.stop)


def _executor_args(opts: Options, kv: str) -> list[str]:
    return ["--dtype", opts.dtype, "--kv-cache-memory", kv, "--block-size", str(opts.block_size),
            "--max-num-seqs", str(opts.max_num_seqs)]


def _vocabulary(model: str) -> tuple[int, frozenset[int]]:
    return model_vocabulary(resolve_model(model).path)


def _job_json(o: Outcome) -> dict:
    return {"request_id": o.job.request_id, "tenant": o.job.tenant, "prompt_tokens": len(o.job.prompt_token_ids),
            "output_tokens": o.job.output_len, "arrival_s": o.job.arrival_s, "latency_s": o.latency_s,
            "ttft_s": o.ttft_s, "queue_s": o.queue_s, "queue_updates": o.queue_updates, "error": o.error}


async def sjf_vs_fcfs(opts: Options) -> dict:
    """Runs the ``sjf-vs-fcfs`` experiment; returns its report."""
    vocab, specials = _vocabulary(opts.model)
    spec = JobSpec(num_requests=opts.num_requests, prompt_median=opts.prompt_median, output_median=opts.output_median,
                   output_sigma=opts.output_sigma, output_range=(2, opts.output_max), rate=opts.rate)
    jobs = make_jobs(spec, opts.seed, vocab, specials)
    kv = opts.kv_cache_memory or "24MiB"
    arms: dict[str, list[dict]] = {"fcfs": [], "sjf": []}
    outcomes_json: dict[str, list] = {"fcfs": [], "sjf": []}
    for i, policy in enumerate(arm_order(("fcfs", "sjf"), opts.rounds)):
        sched = ["--queue-policy", policy, "--max-queue-wait-s", str(opts.aging_bound_s),
                 "--kv-reservation", opts.kv_reservation]
        async with _MeshRun(opts, _executor_args(opts, kv), sched, None, f"{i}-{policy}") as m:
            await _warm_up(m.stub, vocab, specials, opts.executors)
            t0 = time.monotonic()
            outs = await run_open_loop(m.stub, jobs)
            stats = latency_stats(outs)
            stats["wall_s"] = time.monotonic() - t0
            stats["log_dir"] = str(m.log_dir)
        log.info("%s: %s", policy, json.dumps({k: v for k, v in stats.items() if k != "log_dir"}))
        arms[policy].append(stats)
        outcomes_json[policy].append([_job_json(o) for o in outs])

    def mean_of(policy: str, key: str) -> float | None:
        vals = [a[key] for a in arms[policy] if a.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    keys = ("short_half_mean_latency_s", "short_half_p99_latency_s", "long_half_mean_latency_s",
            "long_half_p99_latency_s", "mean_latency_s", "max_wait_s")
    summary = {p: {k: mean_of(p, k) for k in keys} for p in arms}
    for p in arms:
        summary[p]["max_wait_s"] = max((a["max_wait_s"] for a in arms[p] if a["max_wait_s"] is not None),
                                       default=None)
    ratios = {f"{k}_sjf_over_fcfs": ratio(summary["sjf"][k], summary["fcfs"][k]) for k in keys}
    outputs = [j.output_len for j in jobs]
    return {
        "experiment": "sjf-vs-fcfs", "seed": opts.seed, "rounds": opts.rounds,
        "aging_bound_s": opts.aging_bound_s,
        "max_wait_within_aging_bound": (summary["sjf"]["max_wait_s"] or 0.0) <= opts.aging_bound_s,
        "summary": summary, "ratios": ratios, "arms": arms,
        "workload": {**asdict(spec), "seed": opts.seed, "output_len_log_sigma": log_sigma(outputs),
                     "output_len_min": min(outputs), "output_len_max": max(outputs),
                     "output_tokens_total": sum(outputs),
                     "prompt_tokens_total": sum(len(j.prompt_token_ids) for j in jobs)},
        "mesh": {"executors": opts.executors, "executor_args": _executor_args(opts, kv)},
        "outcomes": outcomes_json,
    }


async def quota_isolation(opts: Options) -> dict:
    """Runs the ``quota-isolation`` experiment; returns its report."""
    vocab, specials = _vocabulary(opts.model)
    b_spec = JobSpec(num_requests=opts.b_requests, prompt_median=opts.prompt_median, prompt_sigma=0.3,
                     output_median=opts.b_output_len, output_sigma=0.0,
                     output_range=(opts.b_output_len, opts.b_output_len), rate=opts.b_rate)
    b_jobs = make_jobs(b_spec, opts.seed, vocab, specials, tenant="b", prefix="b")
    a_spec = JobSpec(num_requests=1, prompt_median=opts.a_prompt_len, prompt_sigma=0.0,
                     prompt_range=(opts.a_prompt_len, opts.a_prompt_len), output_median=opts.a_output_len,
                     output_sigma=0.0, output_range=(opts.a_output_len, opts.a_output_len))
    clients = a_clients(opts.quota_blocks, opts.a_demand_factor, opts.a_prompt_len, opts.block_size)

    def a_job(c: int, k: int) -> Job:  # a fresh prompt per call: no prefix-cache help
        j = make_jobs(a_spec, opts.seed * 1_000_003 + c * 10_007 + k + 1, vocab, specials, tenant="a",
                      prefix=f"a-{c}-{k}")[0]
        return Job(f"a-{c}-{k}-{time.monotonic_ns()}", "a", 0.0, j.prompt_token_ids, j.output_len)

    kv = opts.kv_cache_memory or "48MiB"
    tenants = Path(tempfile.mkdtemp(prefix="meshserve-tenants-")) / "tenants.toml"
    tenants.write_text(tenants_toml(opts.quota_blocks))
    arms: dict[str, list[dict]] = {"b-alone": [], "a+b": []}
    outcomes_json: dict[str, list] = {"b-alone": [], "a+b": []}
    async with _MeshRun(opts, _executor_args(opts, kv), [], str(tenants), "quota") as m:
        await _warm_up(m.stub, vocab, specials, opts.executors, tenant="b")
        for r, arm in enumerate(arm_order(("b-alone", "a+b"), opts.rounds)):
            jobs = [Job(f"{j.request_id}-r{r}", j.tenant, j.arrival_s, j.prompt_token_ids, j.output_len)
                    for j in b_jobs]
            stop = asyncio.Event()
            a_task = None
            if arm == "a+b":
                a_task = asyncio.create_task(run_closed_loop(m.stub, clients, a_job, stop))
                await asyncio.sleep(3.0)  # A reaches its quota before B starts
            t0 = time.monotonic()
            b_outs = await run_open_loop(m.stub, jobs)
            stop.set()
            a_outs = await a_task if a_task is not None else []
            stats = {"b": {**ttft_stats(b_outs), **call_counts(b_outs)}, "a": call_counts(a_outs),
                     "wall_s": time.monotonic() - t0}
            stats["a"]["cancelled_at_stop"] = clients if arm == "a+b" else 0  # one call per client, mostly queued
            if a_outs:
                stats["a"].update({f"a_{k}": v for k, v in ttft_stats(a_outs).items()})
            log.info("%s: %s", arm, json.dumps(stats))
            arms[arm].append(stats)
            outcomes_json[arm].append([_job_json(o) for o in b_outs + a_outs])
            await asyncio.sleep(2.0)  # drain between arms
        log_dir = str(m.log_dir)

    def b_mean(arm: str, key: str) -> float | None:
        vals = [a["b"][key] for a in arms[arm] if a["b"][key] is not None]
        return sum(vals) / len(vals) if vals else None

    b_alone, b_beside = b_mean("b-alone", "ttft_p99_s"), b_mean("a+b", "ttft_p99_s")
    return {
        "experiment": "quota-isolation", "seed": opts.seed, "rounds": opts.rounds,
        "b_p99_ttft_alone_s": b_alone, "b_p99_ttft_beside_a_s": b_beside, "b_p99_ratio": ratio(b_beside, b_alone),
        "b_p50_ttft_alone_s": b_mean("b-alone", "ttft_p50_s"), "b_p50_ttft_beside_a_s": b_mean("a+b", "ttft_p50_s"),
        "a_calls": sum(a["a"]["calls"] for a in arms["a+b"]),
        "a_ok": sum(a["a"]["ok"] for a in arms["a+b"]),
        "a_resource_exhausted": sum(a["a"]["resource_exhausted"] for a in arms["a+b"]),
        "a_queued": sum(a["a"]["queued"] for a in arms["a+b"]),
        "a_clients": clients, "quota_blocks": opts.quota_blocks, "a_demand_factor": opts.a_demand_factor,
        "arms": arms,
        "workload": {"b": {**asdict(b_spec), "seed": opts.seed},
                     "a": {"prompt_len": opts.a_prompt_len, "output_len": opts.a_output_len, "clients": clients}},
        "mesh": {"executors": opts.executors, "executor_args": _executor_args(opts, kv), "log_dir": log_dir,
                 "tenants": tenants_toml(opts.quota_blocks)},
        "outcomes": outcomes_json,
    }


def format_summary(report: dict) -> str:
    """The figures a person reads, one per line."""
    def f(v):
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    lines = [f"experiment {report['experiment']}  seed {report['seed']}  rounds {report['rounds']}"]
    if report["experiment"] == "sjf-vs-fcfs":
        w = report["workload"]
        lines.append(f"workload: {w['num_requests']} requests, output log-sigma {w['output_len_log_sigma']:.2f} "
                     f"(range {w['output_len_min']}..{w['output_len_max']}), rate {w['rate']}/s")
        lines.append(f"{'':32s}{'fcfs':>10s}{'sjf':>10s}{'sjf/fcfs':>10s}")
        for k in ("short_half_mean_latency_s", "short_half_p99_latency_s", "long_half_mean_latency_s",
                  "long_half_p99_latency_s", "mean_latency_s", "max_wait_s"):
            lines.append(f"{k:32s}{f(report['summary']['fcfs'][k]):>10s}{f(report['summary']['sjf'][k]):>10s}"
                         f"{f(report['ratios'][k + '_sjf_over_fcfs']):>10s}")
        lines.append(f"aging bound {report['aging_bound_s']} s; sjf max wait within it: "
                     f"{report['max_wait_within_aging_bound']}")
    else:
        for k in ("b_p99_ttft_alone_s", "b_p99_ttft_beside_a_s", "b_p99_ratio", "b_p50_ttft_alone_s",
                  "b_p50_ttft_beside_a_s", "a_clients", "quota_blocks", "a_calls", "a_ok", "a_resource_exhausted",
                  "a_queued"):
            lines.append(f"{k:26s}{f(report[k]):>10s}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Options:
    """``Options`` from the command line."""
    p = argparse.ArgumentParser(prog="python -m meshserve.bench.policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", required=True, choices=EXPERIMENTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-json", default=None)
    p.add_argument("--rounds", type=int, default=1, help="rounds of the two arms (alternating order)")
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default=None, help="per executor (default 24MiB sjf-vs-fcfs, 48MiB quota)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-reservation", choices=("prompt", "predicted"), default="predicted",
                   help="the scheduler's --kv-reservation (sjf-vs-fcfs)")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=8.0, help="sjf-vs-fcfs arrival rate (requests/s)")
    p.add_argument("--output-median", type=int, default=12)
    p.add_argument("--output-sigma", type=float, default=1.2)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--prompt-median", type=int, default=48)
    p.add_argument("--aging-bound-s", type=float, default=20.0, help="the scheduler's --max-queue-wait-s")
    p.add_argument("--b-requests", type=int, default=40)
    p.add_argument("--b-rate", type=float, default=2.0)
    p.add_argument("--b-output-len", type=int, default=16)
    p.add_argument("--quota-blocks", type=int, default=8)
    p.add_argument("--a-demand-factor", type=float, default=10.0)
    p.add_argument("--a-prompt-len", type=int, default=48)
    p.add_argument("--a-output-len", type=int, default=32)
    p.add_argument("--log-dir", default=None, help="services' logs (default: a temp folder)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    return Options(**{k: v for k, v in vars(a).items()})


def main(argv: list[str] | None = None) -> int:
    """Runs one experiment, prints its figures, writes the JSON report."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts = parse_args(argv)
    run = sjf_vs_fcfs if opts.experiment == "sjf-vs-fcfs" else quota_isolation
    report = asyncio.run(run(opts))
    report["options"] = asdict(opts)
    print(format_summary(report))
    if opts.report_json:
        path = Path(opts.report_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"report written to {path}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
