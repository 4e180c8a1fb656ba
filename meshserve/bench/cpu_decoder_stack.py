"""``python -m meshserve.bench.cpu_decoder_stack --batch 1 32 --context 150 --repeat 15
[--dtype bfloat16] [--json FILE]``:
one decode step on one thread with the decoder layers in one C call
(``executor/models/cpu_decoder_stack.c``) against the eager layers, interleaved.

The step is ``plan`` + the model's forward + logits for ``--batch`` requests decoding
one token each over about ``--context`` tokens of a paged KV cache (random keys and
values, scattered blocks: ``meshserve.bench.ceiling``'s forward figure), one process,
one model; each repetition runs it once each way. Both ways call the same C kernels
(GEMMs, fused norm/rotary/SiLU, decode attention); the difference is the Python between
them. Reported per batch: the median wall and thread-CPU milliseconds of each, their
ratio, and whether the logits are bitwise equal (they must be).
"""

from __future__ import annotations

import argparse
import json
import sys

from meshserve.bench.stats import interleaved_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.cpu_decoder_stack",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="requests decoding together")
    parser.add_argument("--context", type=int, default=150, help="context tokens per request (±20%%)")
    parser.add_argument("--repeat", type=int, default=15, help="timed steps per side (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="the model's dtype (default: bfloat16)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(*args.batch, args.context, args.repeat) < 1:
        parser.error("--batch, --context and --repeat must be >= 1")

    import torch

    from executor.model_loader import load_model
    from executor.models.cpu_decoder_stack import DecoderStack
    from meshserve.bench.ceiling import decode_step_inputs
    from meshserve.model_files import resolve_model

    torch.set_num_threads(1)
    loaded = load_model(resolve_model(args.model).path, dtype=args.dtype, max_model_len=None,
                        attention_backend="torch", device="cpu")
    model = loaded.model
    driver = DecoderStack.for_model(model.layers, loaded.dtype)
    if driver is None:
        print("the decoder-stack driver cannot run here (no compiler, or a kernel missing: see the log)",
              file=sys.stderr)
        return 1
    backend = model.attention_layers()[0].backend
    report = {"dtype": args.dtype, "context": args.context, "repeat": args.repeat, "batches": []}
    for batch in args.batch:
        md, input_ids, positions = decode_step_inputs(loaded, batch, args.context)

        def step():
            md.plan = None
            backend.plan(md)
            with torch.inference_mode():
                return model.compute_logits(model(input_ids, positions, md))

        def with_stack(stack):
            model.decoder_stack = stack
            return step()

        ms, logits = interleaved_ms({"eager": lambda: with_stack(None),
                                     "driver": lambda: with_stack(driver)}, args.repeat)
        row = {"batch": batch, "median_ms": ms,
               "cpu_eager_over_driver": round(ms["eager"]["cpu"] / ms["driver"]["cpu"], 3),
               "wall_eager_over_driver": round(ms["eager"]["wall"] / ms["driver"]["wall"], 3),
               "logits_bitwise_equal": bool(torch.equal(logits["eager"], logits["driver"]))}
        report["batches"].append(row)
        print(f"batch {batch:3d}  eager {ms['eager']['cpu']:7.2f} ms  driver {ms['driver']['cpu']:7.2f} ms "
              f"(thread CPU)  eager / driver {row['cpu_eager_over_driver']:.3f}x  "
              f"logits bitwise equal: {row['logits_bitwise_equal']}")
        for layer in model.attention_layers():
            layer.kv_cache = None
    model.decoder_stack = driver
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
