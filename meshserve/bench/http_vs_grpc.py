"""HTTP vs gRPC through one gateway, interleaved: ``python -m meshserve.bench.http_vs_grpc``.

One mesh (launched here with its HTTP API on, or a running one: ``--addr`` and
``--http-addr``) serves rounds of ``--concurrency`` concurrent streaming requests,
each round once over gRPC (``Gateway.Generate``) and once over HTTP
(``POST /v1/completions``, ``stream: true``), the order alternating round by round,
every request with its own seeded random prompt (no prefix-cache hit favours
either side). Every request asks for exactly ``--output-len`` tokens
(``ignore_eos``) and is checked to get them (a short one is an error, not a figure).

Per transport it prints and writes (``--report-json``): requests, failures, output
tokens/s (tokens over the summed wall time of its rounds), TTFT p50/p90 measured
here (submit → first chunk carrying a token), and the HTTP/gRPC ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.client import build_request, channel, generate
from meshserve.v1 import gateway_pb2_grpc


@dataclass
class Side:
    """What one transport measured."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    failures: int = 0

    def summary(self) -> dict:
        return {"requests": len(self.ttft_s) + self.failures, "failures": self.failures,
                "output_tokens": self.tokens, "output_tok_s": self.tokens / self.wall_s if self.wall_s else 0.0,
                "ttft_p50_s": percentile(self.ttft_s, 50, empty=0.0), "ttft_p90_s": percentile(self.ttft_s, 90,
                                                                                               empty=0.0)}


async def _grpc_one(stub, ids: list[int], output_len: int) -> tuple[float, int]:
    start = time.monotonic()
    out = await generate(stub, build_request(ids, max_tokens=output_len, temperature=0, ignore_eos=True))
    return out.client_ttft_s if out.client_ttft_s else out.token_times[0] - start, len(out.token_ids)


async def _http_one(http: httpx.AsyncClient, model: str, ids: list[int], output_len: int) -> tuple[float, int]:
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start, first, count = time.monotonic(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            n = sum(len(c.get("token_ids", ())) for c in chunk["choices"])
            if n and first is None:
                first = time.monotonic() - start
            count += n
    return first or 0.0, count


async def _round(side: Side, send, prompts: list[list[int]], output_len: int) -> None:
    start = time.monotonic()
    results = await asyncio.gather(*(send(p) for p in prompts), return_exceptions=True)
    side.wall_s += time.monotonic() - start
    for r in results:
        if isinstance(r, BaseException) or r[1] != output_len:
            side.failures += 1
            print(f"{side.name}: failed request: {r!r}", file=sys.stderr)
        else:
            side.ttft_s.append(r[0])
            side.tokens += r[1]


async def run(args) -> dict:
    mesh = None
    if args.addr is None:
        log_dir = Path(tempfile.mkdtemp(prefix="meshserve-http-vs-grpc-"))
        mesh = Mesh(MeshConfig(port=0, executors=1, model=args.model, http_port=0, log_dir=log_dir,
                               executor_args=["--dtype", args.dtype, "--max-num-seqs", str(max(8, args.concurrency))]))
        await mesh.start()
        args.addr, args.http_addr = mesh.gateway_address, mesh.http_address
    rng = random.Random(args.seed)
    grpc_side, http_side = Side("grpc"), Side("http")
    try:
        async with channel(args.addr) as ch, httpx.AsyncClient(base_url=f"http://{args.http_addr}",
                                                                 timeout=None) as http:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            sends = {"grpc": lambda p: _grpc_one(stub, p, args.output_len),
                     "http": lambda p: _http_one(http, model, p, args.output_len)}
            sides = {"grpc": grpc_side, "http": http_side}

            def prompts():
                return [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.concurrency)]
            await _round(Side("warm-up"), sends["grpc"], prompts(), args.output_len)  # first-step costs
            await _round(Side("warm-up"), sends["http"], prompts(), args.output_len)
            for r in range(args.rounds):
                order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
                for name in order:
                    await _round(sides[name], sends[name], prompts(), args.output_len)
    finally:
        if mesh is not None:
            await asyncio.to_thread(mesh.stop)
    g, h = grpc_side.summary(), http_side.summary()
    return {"settings": {k: v for k, v in vars(args).items() if k != "report_json"}, "grpc": g, "http": h,
            "ratio_output_tok_s": h["output_tok_s"] / g["output_tok_s"] if g["output_tok_s"] else 0.0,
            "ratio_ttft_p50": h["ttft_p50_s"] / g["ttft_p50_s"] if g["ttft_p50_s"] else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--addr", default=None, help="a running gateway's gRPC host:port (default: launch a mesh)")
    p.add_argument("--http-addr", default=None, help="its HTTP host:port (with --addr)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="rounds per transport (interleaved)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-json", default=None)
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    for name in ("grpc", "http"):
        s = report[name]
        print(f"{name:5s} requests {s['requests']:3d} failures {s['failures']} output {s['output_tok_s']:8.1f} tok/s "
              f"TTFT p50 {s['ttft_p50_s'] * 1000:7.1f} ms p90 {s['ttft_p90_s'] * 1000:7.1f} ms")
    print(f"HTTP/gRPC: output tok/s x{report['ratio_output_tok_s']:.3f}, TTFT p50 x{report['ratio_ttft_p50']:.3f}")
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2))
    return 1 if report["grpc"]["failures"] or report["http"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
