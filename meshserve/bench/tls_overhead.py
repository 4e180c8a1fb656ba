"""Mesh throughput with mutual TLS against plaintext: ``python -m meshserve.bench.tls_overhead``.

Two meshes of real processes (``meshserve.cli.launcher.Mesh``: scheduler, one
executor, gateway) run side by side: one plaintext, one over mutual TLS with
the role certificates of a fresh directory (``meshserve certs``). Rounds
interleave (plaintext, TLS, plaintext, TLS…); each round runs the same seeded
closed-loop workload (``--concurrency`` requests in flight, ``--num-requests``
measured after ``--warmup``) through ``meshserve bench``'s mesh target against
one mesh while the other idles, so both see the same machine. Per arm: the
median of the rounds' output tokens/s; then the ratio TLS / plaintext (goal ≥ 0.95).

It prints numbers and writes a JSON report; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from meshserve.bench import BenchConfig, WorkloadSpec, run_bench
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig


async def run(opts: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-tls-bench-"))
    meshes = {
        "plaintext": Mesh(MeshConfig(port=0, model=opts.model, log_dir=tmp / "plaintext-logs")),
        "mtls": Mesh(MeshConfig(port=0, model=opts.model, log_dir=tmp / "mtls-logs",
                                tls_dir=tmp / "certs")),
    }
    spec = WorkloadSpec(num_requests=opts.num_requests, seed=opts.seed, prompt_len_median=opts.prompt_len_median,
                        output_len_median=opts.output_len_median)
    base = BenchConfig("mesh", concurrency=opts.concurrency, workload=spec, warmup=opts.warmup, model=opts.model)
    rounds: list[dict] = []
    try:
        for mesh in meshes.values():
            await mesh.start()
        for r in range(opts.rounds):
            for arm, mesh in meshes.items():
                cfg = replace(base, addr=mesh.gateway_address, executor_addrs=tuple(mesh.executor_addresses),
                              tls_dir=str(tmp / "certs") if arm == "mtls" else None)
                report = await run_bench(cfg)
                rounds.append({"round": r, "arm": arm, "output_tokens_per_s": report["output_tokens_per_s"],
                               "total_output_tokens": report["total_output_tokens"]})
                print(f"round {r} {arm:9s} {report['output_tokens_per_s']:8.1f} output tokens/s", flush=True)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    medians = {arm: statistics.median(x["output_tokens_per_s"] for x in rounds if x["arm"] == arm)
               for arm in meshes}
    ratio = medians["mtls"] / medians["plaintext"] if medians["plaintext"] else 0.0
    print(f"median output tokens/s: plaintext {medians['plaintext']:.1f}, mutual TLS {medians['mtls']:.1f}; "
          f"ratio {ratio:.3f} (goal >= 0.95)")
    return {"concurrency": opts.concurrency, "num_requests": opts.num_requests, "rounds": rounds,
            "median_output_tokens_per_s": medians, "ratio_mtls_to_plaintext": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="Rounds; each runs plaintext then TLS.")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=16, help="Measured requests per round and arm.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-len-median", type=int, default=150)
    p.add_argument("--output-len-median", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="default")
    p.add_argument("--report-json", default=None)
    opts = p.parse_args()
    report = asyncio.run(run(opts))
    if opts.report_json:
        Path(opts.report_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
