"""Figures of the durable task API and the Redis result cache on a real mesh:
``python -m meshserve.bench.task_cache --redis redis://127.0.0.1:6399/0``.

One mesh of real processes (``meshserve.cli.launcher.Mesh``: scheduler, one
executor, a gateway with ``--task-store`` and ``--result-cache`` on the given
Redis). It measures:

* **cached-answer latency** over gRPC: one greedy request fills the cache, then
  ``--requests`` sequential ``Generate`` calls of it, each answered from Redis;
  p50 / p99 of the client's wall time per call (ms);
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

import redis.asyncio as aioredis

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh, MeshConfig, free_port
from meshserve.client import build_request, channel, generate, get_task, submit_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc


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
    mesh = Mesh(MeshConfig(port=free_port(), task_store=opts.redis, gateway_args=["--result-cache", opts.redis]))
    await mesh.start()
    try:
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            request = build_request("Name three rivers.", max_tokens=16, temperature=0)
            times = await cached_latency(stub, request, opts.requests)
            rate, finished_s = await submit_rate(stub, request, opts.tasks, opts.concurrency)
    finally:
        await asyncio.to_thread(mesh.stop)
    return {"cached_latency_ms": {"p50": 1000 * percentile(times, 50), "p99": 1000 * percentile(times, 99),
                                  "requests": opts.requests},
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
    c, t = report["cached_latency_ms"], report["task_submit"]
    print(f"cached answer over gRPC (Redis): p50 {c['p50']:.2f} ms  p99 {c['p99']:.2f} ms  ({c['requests']} calls)")
    print(f"task submit: {t['tasks_per_s']:.0f} tasks/s ({t['tasks']} tasks, {t['concurrency']} clients); "
          f"all finished after {t['all_finished_s']:.2f} s")
    if opts.report_json:
        with open(opts.report_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    cli()
