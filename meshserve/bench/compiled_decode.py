"""``python -m meshserve.bench.compiled_decode --batch 32 --context 150 --repeat 9
[--wrapper python|cpp] [--json FILE]``:
one float32 decode step on one thread, eager against ``torch.compile``'s graph
(``executor.worker.compiled_decode``, ``--compile``), interleaved in one process.

The step is the model's forward for ``--batch`` requests decoding one token each over
about ``--context`` tokens of a paged KV cache (``meshserve.bench.ceiling.decode_step_inputs``,
as ``meshserve.bench.cpu_fused``), plus the logits: eager (``plan`` + forward) and
compiled (padded to the bucket of ``--batch``, compiled first, the time reported).
``--wrapper`` picks inductor's Python or C++ wrapper (default: the one ``--compile``
uses). Reported: the compile time, the median wall and thread-CPU milliseconds of
each side (on a shared host read the CPU time), their ratio, and whether the hidden
states are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshserve.bench.stats import interleaved_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.compiled_decode",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=150, help="context tokens per request (±20%%)")
    parser.add_argument("--repeat", type=int, default=9, help="timed steps per side (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--wrapper", choices=("python", "cpp"), help="inductor's wrapper (default: --compile's)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.repeat) < 1:
        parser.error("--batch, --context and --repeat must be >= 1")

    import torch

    from executor.model_loader import load_model
    from executor.worker import compiled_decode
    from meshserve.bench.ceiling import decode_step_inputs
    from meshserve.model_files import resolve_model

    torch.set_num_threads(1)
    cache = compiled_decode.inductor_cache_dir()
    loaded = load_model(resolve_model(args.model).path, dtype="float32", max_model_len=None,
                        attention_backend="torch", device="cpu")
    reason = compiled_decode.unavailable_reason(loaded.model, torch.device("cpu"), loaded.dtype, 1)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    md, input_ids, positions = decode_step_inputs(loaded, args.batch, args.context)
    options = dict(compiled_decode.INDUCTOR_OPTIONS)
    if args.wrapper:
        options["cpp_wrapper"] = args.wrapper == "cpp"
    bucket = compiled_decode.bucket_for(args.batch, compiled_decode.decode_buckets(args.batch))
    compiled = compiled_decode.CompiledDecode(loaded.model, md.block_size, loaded.max_model_len, (bucket,), options)
    compiled.warm_up()
    backend = loaded.model.attention_layers()[0].backend

    def eager() -> torch.Tensor:
        md.plan = None
        backend.plan(md)
        return loaded.model(input_ids, positions, md)

    def graph() -> torch.Tensor:
        return compiled.forward(input_ids, positions, md)

    def with_logits(forward) -> torch.Tensor:
        hidden = forward()
        loaded.model.compute_logits(hidden)
        return hidden

    with torch.inference_mode():
        ms, hidden = interleaved_ms({"eager": lambda: with_logits(eager),
                                     "compiled": lambda: with_logits(graph)}, args.repeat)
    report = {"batch": args.batch, "bucket": bucket, "context": args.context, "repeat": args.repeat,
              "cpp_wrapper": bool(options.get("cpp_wrapper")), "cpp_operators": compiled.cpp_ops,
              "inductor_cache": cache,
              "compile_s": round(compiled.compile_seconds[bucket], 1), "median_ms": ms,
              "cpu_eager_over_compiled": round(ms["eager"]["cpu"] / ms["compiled"]["cpu"], 3),
              "wall_eager_over_compiled": round(ms["eager"]["wall"] / ms["compiled"]["wall"], 3),
              "hidden_bitwise_equal": bool(torch.equal(hidden["eager"], hidden["compiled"]))}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
