"""Each request's first token at a burst, the engine in each prefill order (and vLLM):
``python -m meshserve.bench.burst_order [--vllm-python PATH] [--rounds 2] [--report-json F]``.

A closed loop with as many requests in flight as there are requests sends every prompt at
once, and a step of ``max_num_batched_tokens`` takes only some of them: the first tokens
come in groups, one group a step, and which prompts a step takes decides each request's
TTFT (``docs/engine.md``, "Shortest prompts first"). This runs that burst on the bench's
own targets (``meshserve.bench.targets``, the in-process engine as ``--target engine``
runs it; vLLM's offline engine through ``--vllm-python``), one of each system started
once, then rounds of fresh requests (the synthetic workload, round ``r`` seeded ``seed +
7919 r``), every system on the same requests within a round, in turn. It prints, per round
and system, TTFT p50 / mean / p90 / max, output tokens/s and every request's first-token
time from the round's first submission (ms, sorted), and writes them as JSON. Pin it to a
core (``taskset -c 1``) and read systems within a round. No test times it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import replace

from meshserve.bench.config import BenchConfig
from meshserve.bench.loop import RequestResult
from meshserve.bench.targets import make_target
from meshserve.bench.workload import WorkloadSpec, make_warmup, model_vocabulary
from meshserve.bench.workload_kinds import load_workloads
from meshserve.model_files import resolve_model

ROUND_SEED_STRIDE = 7919
ORDERS = ("shortest", "arrival")


def burst_figures(results: list[RequestResult], wall_s: float) -> dict:
    """A round's figures for one system: TTFT (ms) p50, mean, p90, max, output tokens/s, and
    each request's first-token time from the first submission (ms, ascending)."""
    ttft = [(r.token_times[0] - r.submit_time) * 1e3 for r in results]
    start = min(r.submit_time for r in results)
    p90 = statistics.quantiles(ttft, n=10, method="inclusive")[-1] if len(ttft) > 1 else ttft[0]
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.mean(ttft), "ttft_p90_ms": p90,
            "ttft_max_ms": max(ttft), "output_tokens_per_s": sum(r.output_len for r in results) / wall_s,
            "first_token_ms": sorted(round((r.token_times[0] - start) * 1e3) for r in results)}


async def run(config: BenchConfig, systems: list[str], rounds: int) -> list[dict]:
    """``rounds`` bursts of ``config.workload`` on each of ``systems`` (``shortest``,
    ``arrival``: the engine in that prefill order; ``vllm``: ``config.vllm_python``'s vLLM).

    Returns:
        One ``{"round", "seed", "system", **burst_figures}`` per round and system, in run order.
    """
    path = resolve_model(config.model).path
    warmup = make_warmup(config.workload, config.warmup, *model_vocabulary(path))
    targets = {}
    try:
        for name in systems:
            cfg = replace(config, target="vllm") if name == "vllm" else replace(config, prefill_order=name)
            targets[name] = make_target(cfg, path)
            await targets[name].start()
            if warmup is not None:
                await targets[name].run(warmup.requests, len(warmup.requests))
        out = []
        for r in range(rounds):
            seed = config.workload.seed + ROUND_SEED_STRIDE * r
            requests = load_workloads(replace(config.workload, seed=seed), 0, path)[0].requests
            for name, target in targets.items():
                results, wall_s = await target.run(requests, len(requests))
                out.append({"round": r, "seed": seed, "system": name, **burst_figures(results, wall_s)})
                print(f"round {r} {name:9s} TTFT p50 {out[-1]['ttft_p50_ms']:.0f} mean {out[-1]['ttft_mean_ms']:.0f} "
                      f"p90 {out[-1]['ttft_p90_ms']:.0f} max {out[-1]['ttft_max_ms']:.0f} ms, "
                      f"{out[-1]['output_tokens_per_s']:.1f} tokens/s; first tokens (ms) {out[-1]['first_token_ms']}",
                      flush=True)
        return out
    finally:
        for target in targets.values():
            await target.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="also vLLM's offline engine, in this interpreter's environment")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32, help="requests of a burst, all in flight")
    parser.add_argument("--prompt-len-median", type=int, default=150)
    parser.add_argument("--output-len-median", type=int, default=128)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--report-json", help="write the figures here")
    args = parser.parse_args(argv)
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed, prompt_len_median=args.prompt_len_median,
                        output_len_median=args.output_len_median)
    config = BenchConfig("engine", args.num_requests, spec, dtype=args.dtype, num_threads=1,
                         max_num_batched_tokens=args.max_num_batched_tokens, vllm_python=args.vllm_python)
    systems = [*ORDERS, *(["vllm"] if args.vllm_python else [])]
    figures = asyncio.run(run(config, systems, args.rounds))
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump({"config": vars(args), "runs": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
