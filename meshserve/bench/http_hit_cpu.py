"""The gateway's own CPU time per HTTP result-cache hit:
``python -m meshserve.bench.http_hit_cpu --redis redis://127.0.0.1:6411/1 [--hits 2000]``.

The gateway's HTTP app (FastAPI over a ``GatewayCore`` with a Redis result
cache) is called directly with an ASGI scope and a ``POST /v1/completions``
body (no HTTP client, no socket on the HTTP side), after the cache entry of that
request was stored (a synthetic answer: only the hit path runs; the core's mesh
client dials nothing). It prints the CPU time (``time.process_time``) and wall
time per hit, as JSON. Run it with ``PYTHONPATH`` set to two source trees in
turn to compare them (``docs/benchmarks.md``). The Redis database is written to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from transformers import AutoTokenizer

from gateway.collector import CompletedChoice
from gateway.events import ChoiceResult, FinishReason, Timings, Usage
from gateway.generation import GatewayCore
from gateway.http.app import create_app
from gateway.mesh_client import GrpcMeshClient
from gateway.request import GenerationRequest, ModelInfo
from gateway.result_store import RedisResultStore
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.model_files import resolve_model
from meshserve.sampling import SamplingParams

PROMPT = "Name three rivers."
BODY = json.dumps({"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
         "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
         "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                     (b"content-length", str(len(BODY)).encode())],
         "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


async def call(app) -> None:
    """One ``POST /v1/completions`` through the ASGI app.

    Raises:
        RuntimeError: the answer was not 200.
    """
    sent, out = False, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects

    async def send(message: dict) -> None:
        out.append(message)
    await app(dict(SCOPE), receive, send)
    if out[0]["status"] != 200:
        raise RuntimeError(f"HTTP {out[0]['status']}: {out[1:]}")


async def main(url: str, n: int) -> dict:
    """CPU and wall ms per hit over ``n`` hits (after 100 to warm up)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").path)
    model = ModelInfo("bench-model", max_model_len=2048, vocab_size=49152, revision="r1")
    store = RedisResultStore(url)
    core = GatewayCore(tokenizer, model, GrpcMeshClient("127.0.0.1:1"), result_cache=store)
    tenants = TenantRegistry.open()
    request = GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=16, temperature=0.0))
    prepared = core.prepare(request, tenants.authenticate([]))
    core.end(prepared)
    result = ChoiceResult("bench", 0, FinishReason.LENGTH, Usage(5, 16), Timings(0.1, 0.2, 0.1, 0.3),
                          tuple(prepared.prompt_ids), "executor-0")
    await store.put(prepared.cache_key, (CompletedChoice(0, "the Nile, the Amazon and the Rhine.",
                                                         tuple(range(100, 116)), (), result),))
    tasks = TaskAPI(core, tenants, TaskRunner(MemoryTaskStore()))
    app = create_app(core, tenants, tasks, lambda: True, core.metrics.registry)
    for _ in range(100):
        await call(app)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await call(app)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await store.close()
    return {"tree": os.environ.get("PYTHONPATH", ""), "cpu_ms_per_hit": 1000 * cpu / n,
            "wall_ms_per_hit": 1000 * wall / n, "hits": store.hits}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True, help="redis://host:port/db (an entry is written)")
    parser.add_argument("--hits", type=int, default=2000)
    opts = parser.parse_args()
    print(json.dumps(asyncio.run(main(opts.redis, opts.hits))))


if __name__ == "__main__":
    cli()
