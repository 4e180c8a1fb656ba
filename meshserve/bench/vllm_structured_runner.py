"""The script ``python -m meshserve.bench.structured_outputs --vllm-python PATH`` runs in
vLLM's own Python environment: vLLM's offline ``LLM.generate`` on the cases it reads.

It imports only the standard library and vLLM (never meshserve; vLLM is never one of
meshserve's dependencies). Started as ``PYTHON vllm_structured_runner.py --model DIR
--dtype float32``, it reads one JSON document on stdin::

    {"cases": [{"prompt_token_ids": [...], "kind": "json", "spec": ..., "max_tokens": 48}, ...]}

(``kind`` and ``spec`` as vLLM's ``StructuredOutputsParams`` takes them: ``json`` a
schema object, ``regex`` / ``grammar`` a string, ``choice`` a list, ``json_object``
true), runs every case greedily in one ``generate`` call, and writes one JSON line
``{"vllm": VERSION, "outputs": [{"token_ids": [...], "finish_reason": ...}, ...]}`` on
stdout; vLLM's own printing goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="safetensors folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    job = json.loads(sys.stdin.read())
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in job["cases"]]
    params = [SamplingParams(temperature=0.0, max_tokens=case["max_tokens"],
                             structured_outputs=StructuredOutputsParams(**{case["kind"]: case["spec"]}))
              for case in job["cases"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    answers.write(json.dumps({"vllm": vllm.__version__, "outputs": [
        {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
        for o in outputs]}) + "\n")
    answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
