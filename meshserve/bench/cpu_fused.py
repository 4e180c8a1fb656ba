"""``python -m meshserve.bench.cpu_fused --batch 32 --context 150 --repeat 9 [--dtype bfloat16] [--json FILE]``:
one decode step on one thread with the fused CPU kernels (``executor/models/cpu_fused.c``:
RMSNorm with the residual add, rotary, SiLU-and-multiply) against the torch ops, interleaved.

The step is ``plan`` + the model's forward + logits for ``--batch`` requests decoding
one token each over about ``--context`` tokens of a paged KV cache (random keys and
values, scattered blocks: ``meshserve.bench.ceiling``'s forward figure), in one
process, one model: each repetition runs it once with the kernels off and once on.
Reported: median wall and thread-CPU milliseconds of each (on a shared host the CPU
time is the figure to read), their ratio, and whether the two logits agree on every
row's argmax (and their largest difference: 0 when the kernels are bitwise the torch
ops). ``--dtype bfloat16`` runs the model in bfloat16 (the kernels' bfloat16 variants);
on a CPU without native bfloat16 (no AVX512-BF16/AMX) the bfloat16 GEMMs are slow, so the
kernels' share of the step is small there.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshserve.bench.stats import interleaved_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.cpu_fused", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=150, help="context tokens per request (±20%%)")
    parser.add_argument("--repeat", type=int, default=9, help="timed steps per side (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype (default: float32)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.repeat) < 1:
        parser.error("--batch, --context and --repeat must be >= 1")

    import torch

    from executor.model_loader import load_model
    from executor.models import cpu_fused
    from meshserve.bench.ceiling import decode_step_inputs
    from meshserve.model_files import resolve_model

    torch.set_num_threads(1)
    kernels = cpu_fused.load()
    if kernels is None:
        print("the fused CPU kernels could not be built here (see the log)", file=sys.stderr)
        return 1
    loaded = load_model(resolve_model(args.model).path, dtype=args.dtype, max_model_len=None,
                        attention_backend="torch", device="cpu")
    md, input_ids, positions = decode_step_inputs(loaded, args.batch, args.context)
    layers = loaded.model.attention_layers()
    backend = layers[0].backend
    loaded.model.decoder_stack = None  # the eager layers on both sides (the driver: meshserve.bench.cpu_decoder_stack)

    def step() -> torch.Tensor:
        md.plan = None
        backend.plan(md)
        with torch.inference_mode():
            return loaded.model.compute_logits(loaded.model(input_ids, positions, md))

    def with_kernels(k):
        cpu_fused._loaded["k"] = k
        return step()

    try:
        ms, logits = interleaved_ms({"torch": lambda: with_kernels(None), "fused": lambda: with_kernels(kernels)},
                                    args.repeat)
    finally:
        cpu_fused._loaded["k"] = kernels
    report = {"dtype": args.dtype, "batch": args.batch, "context": args.context, "repeat": args.repeat,
              "median_ms": ms,
              "cpu_torch_over_fused": round(ms["torch"]["cpu"] / ms["fused"]["cpu"], 3),
              "wall_torch_over_fused": round(ms["torch"]["wall"] / ms["fused"]["wall"], 3),
              "argmax_equal": bool(torch.equal(logits["torch"].argmax(-1), logits["fused"].argmax(-1))),
              "max_logit_diff": float((logits["torch"] - logits["fused"]).abs().max())}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
