"""Figures of the durable task API and the Redis result cache on a real mesh:
``python -m meshserve.bench.task_cache --redis redis://127.0.0.1:6399/0``.

One mesh of real processes (``meshserve.cli.launcher.Mesh``: scheduler, one
executor, a gateway with ``--task-store`` and ``--result-cache`` on the given
Redis). It measures:

* **cached-answer latency** over gRPC: one greedy request fills the cache, then
  ``--requests`` sequential ``Generate`` calls of it, each answered from Redis;
  p50 / p99 of the client's wall time per call (ms);
* **cached-answer latency** over HTTP: the same prompt, ``max_tokens`` and
  temperature 0 as a non-streamed ``POST /v1/completions`` to the gateway's
  OpenAI-compatible API; one call fills (or reads) the cache, then ``--requests``
  sequential calls, p50 / p99 of the client's wall time. The calls are checked to
  be cache hits: each answers the first call's text, and the scheduler's
  ``meshserve_scheduler_requests_admitted`` counter does not move (an answer from
  the cache reaches no scheduler);
* **task submit throughput**: ``--tasks`` ``SubmitTask`` calls of that cached
  request from ``--concurrency`` clients; submits per second (the time from the
  first submit to the last accepted), then the time until every task finished.

It prints numbers and writes a JSON report (``--report-json``); it asserts nothing.
The Redis database is flushed first: give it one of its own.

**Before/after in one run** (``--compare-tree DIR``): a second gateway is started
from the source tree in ``DIR`` (e.g. ``git archive <commit> | tar -x -C DIR``),
on the same scheduler, executor and Redis, with the same flags; the cached-answer
calls then alternate between the two gateways (A B, B A, A B, …), so both see the
same machine load, and each gateway's p50 / p99 is reported over gRPC and HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Awaitable, Callable

import httpx2 as httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.ports import free_port
from meshserve.client import build_request, channel, generate, get_task, submit_task
from meshserve.grpc_server import wait_serving
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc

PROMPT = "Name three rivers."
MAX_TOKENS = 16


async def cached_latency(stub, request, n: int) -> list[float]:
    """Wall time (s) of ``n`` sequential Generate calls answered from the cache."""
    first = await generate(stub, request)
    if not (await generate(stub, request)).cached:
        raise RuntimeError(f"the second call was not a cache hit (first: {first})")
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await generate(stub, request)
        times.append(time.perf_counter() - start)
    return times


def admitted(metrics_address: str) -> float:
    """Requests the scheduler has assigned to an executor (every label summed), read
    from its Prometheus ``/metrics`` at ``host:port``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "meshserve_scheduler_requests_admitted_total")


async def http_cached_latency(http: httpx.AsyncClient, body: dict, n: int,
                              scheduler_metrics: str) -> tuple[list[float], str, bool]:
    """Wall time (s) of ``n`` sequential non-streamed ``POST /v1/completions`` of
    ``body`` answered from the cache; also the answer's text, and whether the first
    call was already a hit (the gRPC calls' entry).

    Raises:
        RuntimeError: a call failed, answered another text, or reached the scheduler.
    """
    async def post() -> str:
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return response.json()["choices"][0]["text"]

    before_first = await asyncio.to_thread(admitted, scheduler_metrics)
    first = await post()
    before = await asyncio.to_thread(admitted, scheduler_metrics)
    times, texts = [], []
    for _ in range(n):
        start = time.perf_counter()
        texts.append(await post())
        times.append(time.perf_counter() - start)
    after = await asyncio.to_thread(admitted, scheduler_metrics)
    if after != before:
        raise RuntimeError(f"{after - before:.0f} of {n} HTTP calls reached the scheduler: not cache hits")
    if any(t != first for t in texts):
        raise RuntimeError(f"an HTTP call answered another text than the first ({first!r})")
    return times, first, before == before_first


def second_gateway(mesh: Mesh, tree: str, log_path: str) -> tuple[subprocess.Popen, str, str]:
    """Starts a gateway from the source tree ``tree`` with the mesh gateway's flags (new
    ports) and stores (in its environment); returns it, its gRPC address and its HTTP address."""
    args = mesh.command_lines()["gateway"]
    port, http_port = free_port(), free_port()
    for flag, value in (("--port", port), ("--http-port", http_port), ("--metrics-port", free_port())):
        for i, arg in enumerate(args[:-1]):
            if arg == flag:
                args[i + 1] = str(value)
    env = dict(os.environ, **mesh.service_env["gateway"], PYTHONPATH=os.path.abspath(tree), PYTHONUNBUFFERED="1")
    log = open(log_path, "w")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", *args], cwd=tree, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"


async def interleaved(calls: dict[str, Callable[[], Awaitable[object]]], n: int) -> dict[str, list[float]]:
    """Wall time (s) of ``n`` calls of each, alternating: even rounds in the given
    order, odd rounds reversed (neither always goes first)."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            await calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


async def compare(mesh: Mesh, tree: str, request, n: int) -> dict:
    """Cached-answer latency of the baseline tree's gateway and this one's, interleaved."""
    proc, address, http_address = second_gateway(mesh, tree, os.path.join(tree, "bench-gateway.log"))
    try:
        await wait_serving(address, 300)
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        async with channel(mesh.gateway_address) as ours, channel(address) as theirs, \
                httpx.AsyncClient(base_url=f"http://{mesh.http_address}", timeout=60) as ours_http, \
                httpx.AsyncClient(base_url=f"http://{http_address}", timeout=60) as theirs_http:
            stubs = {"baseline": gateway_pb2_grpc.GatewayStub(theirs), "this": gateway_pb2_grpc.GatewayStub(ours)}
            https = {"baseline": theirs_http, "this": ours_http}
            for name in stubs:
                if not (await generate(stubs[name], request)).cached:
                    raise RuntimeError(f"the {name} gateway's call was not a cache hit")

            async def post(http: httpx.AsyncClient) -> None:
                response = await http.post("/v1/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            for http in https.values():
                await post(http)
            before = await asyncio.to_thread(admitted, mesh.metrics_addresses["scheduler"])
            grpc_times = await interleaved({k: (lambda s=s: generate(s, request)) for k, s in stubs.items()}, n)
            http_times = await interleaved({k: (lambda h=h: post(h)) for k, h in https.items()}, n)
            if await asyncio.to_thread(admitted, mesh.metrics_addresses["scheduler"]) != before:
                raise RuntimeError("a compared call reached the scheduler: not a cache hit")
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
    return {name: {"grpc_p50_ms": 1000 * percentile(grpc_times[name], 50),
                   "grpc_p99_ms": 1000 * percentile(grpc_times[name], 99),
                   "http_p50_ms": 1000 * percentile(http_times[name], 50),
                   "http_p99_ms": 1000 * percentile(http_times[name], 99), "requests": n}
            for name in ("baseline", "this")} | {"baseline_tree": os.path.abspath(tree)}


async def submit_rate(stub, request, n: int, concurrency: int) -> tuple[float, float]:
    """(tasks per second submitted, seconds until all finished)."""
    ids: list[str] = []
    queue = iter(range(n))

    async def client() -> None:
        for _ in queue:
            ids.append((await submit_task(stub, request)).task_id)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    submitted = time.perf_counter() - start
    for task_id in ids:
        while (await get_task(stub, task_id)).state in (gateway_pb2.TASK_STATE_QUEUED, gateway_pb2.TASK_STATE_RUNNING):
            await asyncio.sleep(0.01)
    return n / submitted, time.perf_counter() - start


async def main(opts: argparse.Namespace) -> dict:
    r = aioredis.from_url(opts.redis)
    await r.flushdb()
    await r.aclose()
    mesh = Mesh(MeshConfig(port=0, task_store=opts.redis, http_port=0, metrics=True,
                           gateway_args=["--result-cache", opts.redis]))
    await mesh.start()
    try:
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            request = build_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            times = await cached_latency(stub, request, opts.requests)
            grpc_text = (await generate(stub, request)).text
            async with httpx.AsyncClient(base_url=f"http://{mesh.http_address}", timeout=60) as http:
                body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
                http_times, http_text, first_hit = await http_cached_latency(
                    http, body, opts.requests, mesh.metrics_addresses["scheduler"])
            rate, finished_s = await submit_rate(stub, request, opts.tasks, opts.concurrency)
            compared = await compare(mesh, opts.compare_tree, request, opts.requests) if opts.compare_tree else None
    finally:
        await asyncio.to_thread(mesh.stop)
    return {"cached_latency_ms": {"p50": 1000 * percentile(times, 50), "p99": 1000 * percentile(times, 99),
                                  "requests": opts.requests},
            "http_cached_latency_ms": {"p50": 1000 * percentile(http_times, 50),
                                       "p99": 1000 * percentile(http_times, 99), "requests": opts.requests,
                                       "first_call_hit_grpc_entry": first_hit,
                                       "same_text_as_grpc": http_text == grpc_text},
            "task_submit": {"tasks": opts.tasks, "concurrency": opts.concurrency, "tasks_per_s": rate,
                            "all_finished_s": finished_s},
            "compared": compared}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True, help="redis://host:port/db (flushed first)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--compare-tree", default=None, help="a source tree whose gateway is measured against "
                        "this one's, interleaved (see the module docstring)")
    opts = parser.parse_args()
    report = asyncio.run(main(opts))
    c, h, t = report["cached_latency_ms"], report["http_cached_latency_ms"], report["task_submit"]
    print(f"cached answer over gRPC (Redis): p50 {c['p50']:.2f} ms  p99 {c['p99']:.2f} ms  ({c['requests']} calls)")
    print(f"cached answer over HTTP (Redis): p50 {h['p50']:.2f} ms  p99 {h['p99']:.2f} ms  ({h['requests']} calls; "
          f"first call hit the gRPC entry: {h['first_call_hit_grpc_entry']}, "
          f"same text as gRPC: {h['same_text_as_grpc']})")
    print(f"task submit: {t['tasks_per_s']:.0f} tasks/s ({t['tasks']} tasks, {t['concurrency']} clients); "
          f"all finished after {t['all_finished_s']:.2f} s")
    if report["compared"]:
        for name in ("baseline", "this"):
            r = report["compared"][name]
            print(f"interleaved, {name:8s} gateway: gRPC p50 {r['grpc_p50_ms']:.2f} ms  p99 {r['grpc_p99_ms']:.2f} ms"
                  f"   HTTP p50 {r['http_p50_ms']:.2f} ms  p99 {r['http_p99_ms']:.2f} ms  ({r['requests']} calls each)")
    if opts.report_json:
        with open(opts.report_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    cli()
