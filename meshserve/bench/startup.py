"""``python -m meshserve.bench.startup --max-num-seqs 4 --inductor-cache DIR [--json FILE]``:
how long an engine takes to start, eager and with ``--compile``, the compile cache
cold and warm.

Each start is a fresh Python process (``--child``) that imports the engine, builds an
``LLMEngine`` (the model loaded, the KV cache allocated and, with ``--compile``, every
decode bucket of ``--max-num-seqs`` compiled: ``executor.worker.compiled_decode``) and
runs two 2-token greedy requests, timing the three (wall seconds), and the CPU
seconds of the whole process with the compilers it ran. The starts, in order: eager;
compiled with ``--inductor-cache`` emptied first (cold); compiled again (warm: the
FX-graph, AOTAutograd and C++ caches it left; Dynamo still traces); eager again.
The C kernels' own cache (``$MESHSERVE_CACHE_DIR/kernels``) is left as it is (warm
after the first start). Reported per start: seconds of imports, engine, first
requests, and the compile seconds of each bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time


def _child(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from meshserve.sampling import SamplingParams

    imported = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", num_threads=1, compile=args.compile,
                                    cache=CacheConfig(num_blocks=64),
                                    batch=BatchSchedulerConfig(max_num_seqs=args.max_num_seqs)))
    built = time.perf_counter()
    engine.generate([[1, 2, 3, 4, 5]] * 2, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    done = time.perf_counter()
    compiled = engine.worker_group.worker.model_runner.compiled_decode
    print(json.dumps({"import_s": round(imported - start, 2), "engine_s": round(built - imported, 2),
                      "first_requests_s": round(done - built, 2),
                      "compile_s": {} if compiled is None else
                      {str(k): round(v, 1) for k, v in compiled.compile_seconds.items()},
                      "compiled_steps": 0 if compiled is None else compiled.steps}))


def _start(args: argparse.Namespace, compile: bool) -> dict:
    cmd = [sys.executable, "-m", "meshserve.bench.startup", "--child", "--model", args.model,
           "--max-num-seqs", str(args.max_num_seqs), *(["--compile"] if compile else [])]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.abspath(args.inductor_cache))
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - wall, 2)
    # CPU seconds of the process and of what it ran (the C++ compiler): the figure to read on a shared host
    result["process_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=4, help="the engine's; its decode buckets are compiled")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--inductor-cache",
                        help="inductor's cache folder for the compiled starts (emptied before the cold one)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be >= 1")
    if not args.child and not args.inductor_cache:
        parser.error("--inductor-cache DIR is required (it is emptied for the cold start)")
    if args.child:
        _child(args)
        return 0
    shutil.rmtree(args.inductor_cache, ignore_errors=True)
    report = {"max_num_seqs": args.max_num_seqs, "model": args.model, "starts": {}}
    for name, compile in (("eager", False), ("compile_cold", True), ("compile_warm", True), ("eager_again", False)):
        report["starts"][name] = _start(args, compile)
        print(name, json.dumps(report["starts"][name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
