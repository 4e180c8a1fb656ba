"""The script ``meshserve bench --baseline vllm`` runs in vLLM's own Python environment.

It imports only the standard library and vLLM (never meshserve: the environment
named by ``--vllm-python`` need not have meshserve's dependencies, and vLLM is
never one of them). Started as ``PYTHON vllm_runner.py --model DIR --dtype
float32 --threads 1 ...``, it builds vLLM's offline engine (``vllm.LLMEngine``
in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, like the engine target's
in-process engine; ``VLLM_CPU_OMP_THREADS_BIND`` = the first ``threads`` cores
this process may run on, so ``taskset -c 1 meshserve bench ...`` puts both systems
on core 1),
prints one JSON line ``{"ready": true, "vllm": VERSION}`` and then serves runs,
one JSON line each on stdin::

    {"concurrency": 8, "requests": [{"id": "r0", "prompt_token_ids": [...], "output_len": 128}, ...]}

Each run is the closed loop of ``meshserve bench``: at most ``concurrency``
requests in the engine, the next one added as soon as one finishes; greedy,
``ignore_eos``, exactly ``output_len`` tokens (``min_tokens = max_tokens``). It
answers one JSON line::

    {"results": [{"id", "submit", "token_times": [...], "end"}], "wall_s": ...}

with ``time.monotonic()`` times (one clock for every process of the machine on
Linux, so the parent's report reads them as its own). Only these lines go to
stdout: anything vLLM or torch prints goes to stderr. An empty line or EOF ends
it. Errors go to stderr and end the process with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_engine(args):
    """vLLM's in-process offline engine for ``args``; its block size is its own (its CPU
    attention refuses 16, the engine's default: it needs a multiple of 32)."""
    from vllm import EngineArgs, LLMEngine

    engine_args = EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             long_prefill_token_threshold=args.long_prefill_token_threshold,
                             enable_prefix_caching=args.enable_prefix_caching, seed=0,
                             max_model_len=args.max_model_len, disable_log_stats=True)
    return LLMEngine.from_engine_args(engine_args)


def run_closed_loop(engine, requests: list[dict], concurrency: int) -> dict:
    """Runs ``requests`` with at most ``concurrency`` in the engine; their token times."""
    from vllm import SamplingParams

    pending = list(reversed(requests))
    times: dict[str, list[float]] = {}
    submit: dict[str, float] = {}
    end: dict[str, float] = {}
    seen: dict[str, int] = {}
    in_flight = 0
    start = time.monotonic()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            req = pending.pop()
            n = int(req["output_len"])
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
            submit[req["id"]] = time.monotonic()
            times[req["id"]], seen[req["id"]] = [], 0
            engine.add_request(req["id"], {"prompt_token_ids": list(req["prompt_token_ids"])}, params)
            in_flight += 1
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            count = len(out.outputs[0].token_ids)  # cumulative output: the new ones are past `seen`
            times[out.request_id].extend([now] * (count - seen[out.request_id]))
            seen[out.request_id] = count
            if out.finished:
                end[out.request_id] = now
                in_flight -= 1
    wall = time.monotonic() - start
    return {"results": [{"id": r["id"], "submit": submit[r["id"]], "token_times": times[r["id"]],
                         "end": end[r["id"]]} for r in requests], "wall_s": wall}


def omp_threads_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: the first ``threads`` cores of this process's
    affinity mask, comma-separated (all of them when it has fewer)."""
    cores = sorted(os.sched_getaffinity(0))[:max(1, threads)]
    return ",".join(str(core) for core in cores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="safetensors folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(args.threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, args.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    answers = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout ...
    os.dup2(2, 1)  # ... and whatever vLLM or torch print (banners, warnings) goes to stderr
    import vllm

    engine = build_engine(args)

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    answer({"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        answer(run_closed_loop(engine, job["requests"], int(job["concurrency"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
