"""``python -m meshserve.bench.parallel``: one executor's engine at a tensor- and
pipeline-parallel layout: throughput, TPOT, and the communication per token per layer.

Runs a fixed seeded workload (``--requests`` prompts of ``--prompt-len`` random
ordinary token ids, greedy, ``--max-tokens`` each, all submitted at once) through
an ``LLMEngine`` whose worker group spans ``--tensor-parallel-size`` ×
``--pipeline-parallel-size`` ranks, stepping it by hand, and prints one JSON
line (``--json`` also writes it):

* ``throughput_tok_s``: generated tokens / wall seconds of the run (after load);
* ``tpot_ms``: mean over requests of (last token time - first token time) /
  (tokens - 1), milliseconds;
* ``bytes_per_token_per_layer``: rank 0's collective payload bytes
  (``executor.models.parallel.COMM``: all-reduced, all-gathered, sent point to
  point) divided by the tokens run through the model and by the layers; the
  step inputs broadcast to the other ranks are reported apart
  (``broadcast_bytes_per_step``).

Example (what docs/parallelism.md reports)::

    python -m meshserve.bench.parallel --tensor-parallel-size 3 --json tp3.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def run(args: argparse.Namespace) -> dict:
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig, ParallelConfig
    from executor.engine.llm_engine import LLMEngine
    from executor.models.parallel import COMM
    from meshserve.sampling import SamplingParams

    config = EngineConfig(model=args.model, dtype="float32", max_model_len=1024, num_threads=args.num_threads,
                          cache=CacheConfig(block_size=16, num_blocks=256),
                          batch=BatchSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
                          parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                                  pipeline_parallel_size=args.pipeline_parallel_size))
    started = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", torch.randint(100, engine.vocab_size - 100, (args.prompt_len,),
                                                  generator=gen).tolist(), params)
    COMM.reset()
    token_times: dict[str, list[float]] = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_times.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.new_token_ids))
    wall_s = time.perf_counter() - started
    generated = sum(len(t) for t in token_times.values())
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    layers, tokens = engine.kv_layout.num_layers, engine.num_forward_tokens
    comm = COMM.all_reduce_bytes + COMM.all_gather_bytes + COMM.p2p_bytes
    result = {
        "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
        "model": engine.model_id, "requests": args.requests, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "load_s": round(load_s, 1), "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(generated / wall_s, 1), "tpot_ms": round(1000 * sum(tpots) / len(tpots), 1),
        "forward_tokens": tokens, "steps": engine.num_steps,
        "all_reduce_bytes_per_token_per_layer": round(COMM.all_reduce_bytes / tokens / layers, 1),
        "all_reduce_calls_per_step": round(COMM.all_reduce_calls / max(1, engine.num_steps), 1),
        "all_gather_bytes_per_token": round(COMM.all_gather_bytes / tokens, 1),
        "p2p_bytes_per_token": round(COMM.p2p_bytes / tokens, 1),
        "bytes_per_token_per_layer": round(comm / tokens / layers, 1),
        "broadcast_bytes_per_step": round(COMM.broadcast_bytes / max(1, engine.num_steps)),
    }
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of each rank")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args)
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
