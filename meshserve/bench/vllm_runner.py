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
requests in the engine, the next one submitted as soon as one finishes and added as
an asynchronous engine would take it (``run_closed_loop``); greedy, ``ignore_eos``,
exactly ``output_len`` tokens (``min_tokens = max_tokens``). It
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


def run_closed_loop(engine, requests: list[dict], concurrency: int, sampling_params=None) -> dict:
    """Runs ``requests`` with at most ``concurrency`` in the engine; their token times.

    ``engine``: ``add_request(id, prompt, params)`` and ``step() -> outputs``, as
    ``vllm.LLMEngine``; ``sampling_params(n)``: the parameters of a request of ``n``
    output tokens (None: vLLM's ``SamplingParams``, greedy, exactly ``n`` tokens).

    Arrivals are those an asynchronous engine sees (meshserve's ``AsyncEngine`` behind the
    engine target, vLLM's own ``AsyncLLM`` behind its server): a closed-loop client sends
    its next request when its last one ends, by which time such an engine is already
    running its next step, so the request joins the step after it. This loop steps the
    engine itself and could add it before that next step, a whole step sooner than any
    server can, which would take a step off vLLM's TTFT at 8 and 32 requests that no
    server gives it. So a request submitted while others run is submitted (its TTFT
    starts) at once and added after the next step; one submitted to an idle engine
    (nothing in flight) is added at once, as an idle server takes it.
    """
    if sampling_params is None:
        from vllm import SamplingParams

        def sampling_params(n):
            return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    pending = list(reversed(requests))
    times: dict[str, list[float]] = {}
    submit: dict[str, float] = {}
    end: dict[str, float] = {}
    seen: dict[str, int] = {}
    arrived: list[dict] = []  # submitted while a step ran: added after the next one
    in_flight = 0
    start = time.monotonic()

    def add(req: dict) -> None:
        nonlocal in_flight
        engine.add_request(req["id"], {"prompt_token_ids": list(req["prompt_token_ids"])},
                           sampling_params(int(req["output_len"])))
        in_flight += 1

    while pending or in_flight or arrived:
        for req in arrived:
            add(req)
        arrived, busy = [], in_flight > 0
        while pending and in_flight + len(arrived) < concurrency:
            req = pending.pop()
            submit[req["id"]] = time.monotonic()
            times[req["id"]], seen[req["id"]] = [], 0
            if busy:
                arrived.append(req)
            else:
                add(req)
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
