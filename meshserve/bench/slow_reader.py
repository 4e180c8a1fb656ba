"""A slow stream reader on the real mesh: ``python -m meshserve.bench.slow_reader``.

One mesh of real processes (``meshserve.cli.launcher.Mesh``: scheduler, one executor
with ``--max-buffered-outputs``, gateway). Two arms alternate on it, each
``--duration-s`` long: ``alone`` (4 normal streaming clients, closed loop) and
``slow`` (the same 4 plus one slow reader: ``--slow-max-tokens`` tokens,
``ignore_eos``, 5 top logprobs, read at one message per ``--read-interval-s``
through a channel with a 1 KiB HTTP/2 stream window; this arm lasts until the
executor has ended the slow request, at most ``--max-wait-s`` more). Per arm: the normal
clients' inter-token latency (gaps between streamed tokens) p50 and p90; for the
slow reader, whether the executor ended it (its ``slow_reader_aborts`` metric
and the KV blocks free once the normal clients stop), and, after the arm, the
status it reads once it drains what was sent (RESOURCE_EXHAUSTED expected).
Then the ratio slow / alone of the normal clients' ITL p50 (goal ≤ 1.2).

It prints numbers and writes a JSON report; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.client import build_request, channel, generate
from meshserve.grpc_server import CHANNEL_OPTIONS, open_channel
from meshserve.tls import PLAINTEXT
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2_grpc

log = logging.getLogger(__name__)
QUESTIONS = ("Name a color.", "Count to five.", "What is 2+2?", "Say hello in French.")
SLOW_CLIENT_OPTIONS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))


def itl_gaps(token_times: list[float]) -> list[float]:
    """Seconds between consecutive streamed tokens of one completion."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


async def normal_clients(stub, max_tokens: int, stop: asyncio.Event) -> list[float]:
    """4 closed-loop clients until ``stop``; their inter-token gaps (s)."""
    gaps: list[float] = []

    async def loop(q: str) -> None:
        while not stop.is_set():
            out = await generate(stub, build_request(chat=[("user", q)], max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True))
            gaps.extend(itl_gaps(out.token_times))

    await asyncio.gather(*(loop(q) for q in QUESTIONS))
    return gaps


async def slow_reader(address: str, max_tokens: int, interval_s: float, stop: asyncio.Event) -> dict:
    """Reads one message per ``interval_s`` until ``stop``, then drains; its outcome."""
    async with open_channel(address, PLAINTEXT, CHANNEL_OPTIONS + SLOW_CLIENT_OPTIONS) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(build_request(
            chat=[("user", "Tell me a very long story.")], max_tokens=max_tokens, temperature=0, ignore_eos=True,
            logprobs=5))
        tokens = messages = 0
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                messages += 1
                if msg.WhichOneof("kind") == "delta":
                    tokens += len(msg.delta.token_ids)
                if not stop.is_set():
                    await asyncio.sleep(interval_s)
            code, details = "OK", ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details()
    return {"tokens_read": tokens, "messages_read": messages, "code": code, "details": details}


def scrape(url: str, name: str) -> float:
    """The value of the un-labelled sample ``name`` at a /metrics ``url``."""
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


async def run(opts: argparse.Namespace) -> dict:
    log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="meshserve-c27-"))
    cfg = MeshConfig(port=0, executors=1, model=opts.model, log_dir=log_dir, metrics=True,
                     executor_args=["--dtype", opts.dtype, "--kv-cache-memory", opts.kv_cache_memory,
                                    "--max-buffered-outputs", str(opts.max_buffered_outputs)])
    mesh = Mesh(cfg)
    await mesh.start()
    arms: list[dict] = []
    try:
        metrics_url = f"http://{mesh.metrics_addresses['executor-0']}/metrics"
        async with channel(mesh.gateway_address) as ch, channel(mesh.executor_addresses[0]) as ech:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            warm = asyncio.Event()
            warm_task = asyncio.create_task(normal_clients(stub, 8, warm))
            await asyncio.sleep(1.0)
            warm.set()
            await warm_task
            order = [a for r in range(opts.rounds) for a in (("alone", "slow") if r % 2 == 0 else ("slow", "alone"))]
            for arm in order:
                stop = asyncio.Event()
                aborts_before = scrape(metrics_url, "meshserve_executor_slow_reader_aborts_total")
                normal = asyncio.create_task(normal_clients(stub, opts.normal_max_tokens, stop))
                slow = (asyncio.create_task(slow_reader(mesh.gateway_address, opts.slow_max_tokens,
                                                        opts.read_interval_s, stop)) if arm == "slow" else None)
                started = time.monotonic()
                await asyncio.sleep(opts.duration_s)
                while arm == "slow" and time.monotonic() - started < opts.duration_s + opts.max_wait_s:
                    if scrape(metrics_url, "meshserve_executor_slow_reader_aborts_total") > aborts_before:
                        break
                    await asyncio.sleep(1.0)
                aborted = scrape(metrics_url, "meshserve_executor_slow_reader_aborts_total") - aborts_before
                arm_s = time.monotonic() - started
                stop.set()
                gaps = await normal
                stats = await executor_pb2_grpc.ExecutorStub(ech).Stats(executor_pb2.StatsRequest())
                result = {"arm": arm, "seconds": arm_s,
                          "itl_p50_s": percentile(gaps, 50, empty=0.0), "itl_p90_s": percentile(gaps, 90, empty=0.0),
                          "tokens": len(gaps), "slow_reader_aborts": aborted,
                          "free_blocks_after": stats.num_free_blocks, "num_blocks": stats.num_blocks}
                if slow is not None and aborted:
                    result["slow_reader"] = await slow  # drains what was sent, then reads the status
                elif slow is not None:  # never ended by the executor: the bench gives up on it
                    slow.cancel()
                    result["slow_reader"] = {"code": "not ended by the executor (cancelled by the bench)"}
                arms.append(result)
                print(json.dumps(result), flush=True)
    finally:
        await asyncio.to_thread(mesh.stop)

    def median_p50(arm: str) -> float:
        return statistics.median(a["itl_p50_s"] for a in arms if a["arm"] == arm)

    report = {"config": {k: v for k, v in vars(opts).items() if k != "report_json"}, "arms": arms,
              "itl_p50_alone_s": median_p50("alone"), "itl_p50_slow_s": median_p50("slow")}
    report["itl_p50_ratio"] = report["itl_p50_slow_s"] / report["itl_p50_alone_s"]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshserve.bench.slow_reader", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-buffered-outputs", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=2, help="Rounds of (alone, slow), alternating the order.")
    p.add_argument("--slow-max-tokens", type=int, default=4000)
    p.add_argument("--normal-max-tokens", type=int, default=64)
    p.add_argument("--read-interval-s", type=float, default=1.0)
    p.add_argument("--max-wait-s", type=float, default=180.0,
                   help="How much longer than --duration-s a slow arm waits for the executor to end the slow request.")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--report-json", default=None)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = asyncio.run(run(opts))
    print(f"normal clients' ITL p50: alone {report['itl_p50_alone_s'] * 1e3:.1f} ms, with a slow reader "
          f"{report['itl_p50_slow_s'] * 1e3:.1f} ms, ratio {report['itl_p50_ratio']:.3f}")
    if opts.report_json:
        Path(opts.report_json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.report_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
