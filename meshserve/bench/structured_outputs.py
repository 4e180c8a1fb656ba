"""Structured outputs against vLLM, and what their masks cost a step.

``python -m meshserve.bench.structured_outputs [--vllm-python PATH] [--report-dir DIR]``

1. **Answers**: ``CASES`` (JSON Schemas, a JSON object, regexes, choices, an EBNF grammar,
   each a chat question to the default model) run greedily in the engine and, with
   ``--vllm-python``, in vLLM's offline engine in its own environment
   (``vllm_structured_runner.py``); the token ids are compared case by case. Both use
   xgrammar, so in float32 they should agree token for token.
2. **Cost**: on one torch thread, the time to fill one request's bitmask
   (``GrammarState.bitmask``) and to apply 32 rows' masks to ``(32, vocab_size)``
   logits (``GrammarMask.apply``), medians of 50; and the sampler's step for 32 greedy
   rows with and without masks.

Prints a table and, with ``--report-dir``, writes ``report.json`` there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"]}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"], "additionalProperties": False}
CASES = (
    ("json", CAT, "Give me a JSON object describing a cat with a name and an age."),
    ("json", CITY, "Describe Paris as JSON."),
    ("json_object", True, "Describe a dog as JSON."),
    ("regex", r"[0-9]{3}-[a-z]{2,5}", "Make up a product code."),
    ("choice", ["yes", "no", "maybe"], "Is the sky blue? Answer yes or no."),
    ("choice", ["Paris", "London", "Berlin", "Rome"], "What is the capital of France?"),
    ("grammar", 'root ::= "The answer is " ("red" | "blue") "."', "What colour is the sea?"),
    ("regex", r"(Monday|Tuesday|Friday), [0-9]{1,2} (May|June) 20[0-9]{2}", "When shall we meet?"),
)
"""(kind, spec as vLLM's ``StructuredOutputsParams`` takes it, question)."""
MAX_TOKENS = 48
RUNNER = Path(__file__).with_name("vllm_structured_runner.py")


def spec_of(kind: str, spec):
    """A case's ``StructuredOutput``."""
    from meshserve.structured_output import StructuredOutput, json_spec

    if kind == "json":
        return StructuredOutput("json", json_spec(spec))
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(spec))
    return StructuredOutput(kind, spec)


def prompts(tokenizer) -> list[list[int]]:
    """Each case's question as a chat-templated prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for _, _, q in CASES]


def run_engine(engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The engine's greedy answers to every case (one ``generate`` call)."""
    from meshserve.sampling import SamplingParams

    return engine.generate(prompt_ids, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       structured_output=spec_of(kind, spec))
                                        for kind, spec, _ in CASES])


def run_vllm(python: str, model_path: Path, dtype: str, prompt_ids: list[list[int]]) -> dict:
    """vLLM's answers (``vllm_structured_runner.py`` in the environment of ``python``).

    Raises:
        RuntimeError: the runner failed (its stderr's tail in the message).
    """
    job = {"cases": [{"prompt_token_ids": ids, "kind": kind, "spec": spec, "max_tokens": MAX_TOKENS}
                     for ids, (kind, spec, _) in zip(prompt_ids, CASES)]}
    done = subprocess.run([python, str(RUNNER), "--model", str(model_path), "--dtype", dtype],
                          input=json.dumps(job), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's runner failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(ours: list[list[int]], theirs: list[list[int]]) -> list[dict]:
    """Per case: equal or not, and the first position where the token ids differ."""
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"equal": a == b, "first_difference": first})
    return rows


def _median_ms(fn, n: int = 50) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def mask_costs(engine, rows: int = 32) -> dict:
    """Milliseconds (medians): one bitmask fill inside a JSON string, ``rows`` masks
    applied, and the sampler's step for ``rows`` greedy rows without and with masks."""
    import torch

    from executor.engine.structured_output import GrammarState
    from executor.worker.grammar_mask import GrammarMask
    from executor.worker.sampler import Sampler, SamplingBatch
    from meshserve.sampling import SamplingParams

    state = GrammarState(engine.grammars.compile(spec_of("json_object", True)))
    for token in (107, 3805, 476):  # '{', '\n  ', '"': inside a key, nearly every token allowed
        state.accept(token)
    bitmasks = [state.bitmask()] * rows
    logits = torch.randn(rows, engine.vocab_size, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * rows
    sampler = Sampler()
    plain = SamplingBatch.build(params, [None] * rows, engine.vocab_size)
    masked = SamplingBatch.build(params, [None] * rows, engine.vocab_size, grammar_bitmasks=bitmasks)
    return {"bitmask_fill_ms": _median_ms(state.bitmask),
            "apply_ms": _median_ms(lambda: GrammarMask.build(bitmasks).apply(logits.clone()))
            - _median_ms(logits.clone),
            "sampler_plain_ms": _median_ms(lambda: sampler(logits, plain)),
            "sampler_masked_ms": _median_ms(lambda: sampler(logits, masked)), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the Python of an environment with vLLM (compares answers)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--report-dir", type=Path)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from executor.engine.config import CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from meshserve.model_files import resolve_model

    torch.set_num_threads(1)
    model = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, cache=CacheConfig(num_blocks=256)))
    prompt_ids = prompts(tokenizer)
    ours = run_engine(engine, prompt_ids)
    report = {"dtype": args.dtype, "cases": [{"kind": k, "question": q, "ours": {"token_ids": o,
                                                                                 "text": tokenizer.decode(o)}}
                                             for (k, _, q), o in zip(CASES, ours)],
              "costs": mask_costs(engine)}
    if args.vllm_python:
        theirs = run_vllm(args.vllm_python, model.path, args.dtype, prompt_ids)
        report["vllm"] = theirs["vllm"]
        for case, output, row in zip(report["cases"], theirs["outputs"],
                                     compare(ours, [o["token_ids"] for o in theirs["outputs"]])):
            case["vllm"] = {"token_ids": output["token_ids"], "text": tokenizer.decode(output["token_ids"]),
                            "finish_reason": output["finish_reason"]}
            case.update(row)
    engine.shutdown()
    print(f"{'kind':<12} {'equal':<6} answer")
    for case in report["cases"]:
        equal = "-" if "equal" not in case else ("yes" if case["equal"] else f"no@{case['first_difference']}")
        print(f"{case['kind']:<12} {equal:<6} {case['ours']['text']!r}")
    costs = report["costs"]
    print(f"bitmask fill {costs['bitmask_fill_ms']:.3f} ms a request; {costs['rows']} masks applied "
          f"{costs['apply_ms']:.3f} ms; sampler step {costs['sampler_plain_ms']:.3f} ms plain, "
          f"{costs['sampler_masked_ms']:.3f} ms masked")
    if args.report_dir:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
