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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

import httpx2 as httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh, MeshConfig, free_port
from meshserve.client import build_request, channel, generate, get_task, submit_task
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
    mesh = Mesh(MeshConfig(port=free_port(), task_store=opts.redis, http_port=0, metrics=True,
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
    finally:
        await asyncio.to_thread(mesh.stop)
    return {"cached_latency_ms": {"p50": 1000 * percentile(times, 50), "p99": 1000 * percentile(times, 99),
                                  "requests": opts.requests},
            "http_cached_latency_ms": {"p50": 1000 * percentile(http_times, 50),
                                       "p99": 1000 * percentile(http_times, 99), "requests": opts.requests,
                                       "first_call_hit_grpc_entry": first_hit,
                                       "same_text_as_grpc": http_text == grpc_text},
            "task_submit": {"tasks": opts.tasks, "concurrency": opts.concurrency, "tasks_per_s": rate,
                            "all_finished_s": finished_s}}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True, help="redis://host:port/db (flushed first)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--report-json", default=None)
    opts = parser.parse_args()
    report = asyncio.run(main(opts))
    c, h, t = report["cached_latency_ms"], report["http_cached_latency_ms"], report["task_submit"]
    print(f"cached answer over gRPC (Redis): p50 {c['p50']:.2f} ms  p99 {c['p99']:.2f} ms  ({c['requests']} calls)")
    print(f"cached answer over HTTP (Redis): p50 {h['p50']:.2f} ms  p99 {h['p99']:.2f} ms  ({h['requests']} calls; "
          f"first call hit the gRPC entry: {h['first_call_hit_grpc_entry']}, "
          f"same text as gRPC: {h['same_text_as_grpc']})")
    print(f"task submit: {t['tasks_per_s']:.0f} tasks/s ({t['tasks']} tasks, {t['concurrency']} clients); "
          f"all finished after {t['all_finished_s']:.2f} s")
    if opts.report_json:
        with open(opts.report_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    cli()
