"""``python -m meshserve.bench.cpu_gemm --rows 1 8 32 150 [--dtype bfloat16] [--repeat 7]
[--json FILE]``: the model's linear layers on one thread through the three CPU GEMMs the
engine can use, interleaved: plain ``F.linear`` (MKL or oneDNN), oneDNN on its packed
weight, and our kernel on its panels (``cpu_gemm.c`` for float32, ``cpu_gemm_bf16.c`` for
bfloat16 on a CPU with AVX512-BF16, ``cpu_gemm_amx.c`` on one with AMX-BF16 unless
``MESHSERVE_CPU_GEMM_AMX=0``; ``executor/models/cpu_gemm.py``).

For each ``--rows`` (tokens in a step) and each weight shape of the model (``qkv``,
``o``, ``gate_up``, ``down`` for every layer, the LM head once), random inputs and
weights of that shape in ``--dtype``; each repetition times every implementation once in turn, by
thread CPU time (the figure to read on a shared host). Reported per shape: median
milliseconds and GFLOP/s of each, and the step's total (layers x the four projections
+ the LM head) with the speed-up of our kernel over oneDNN. The largest difference
from a float64 product of the same (rounded) inputs is kept in the JSON report: in float32
all three round within ~1e-5 of it; in bfloat16 all three sum in float32 and round the
output once to bfloat16.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time


def shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``name -> (out_features, in_features)`` of a Llama-style model's linear layers."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads))
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inter = int(hf_config.intermediate_size)
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (int(hf_config.vocab_size), hidden)}


def _thread_ms(fn) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.cpu_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 150], help="tokens in a step")
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per implementation (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeat < 1:
        parser.error("--rows and --repeat must be >= 1")

    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    from executor.models import cpu_gemm
    from meshserve.model_files import resolve_model

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    kernel = cpu_gemm.load() if dtype == torch.float32 else cpu_gemm.load_bf16()
    if kernel is None:
        print(f"the {args.dtype} CPU GEMM kernel could not be built here (see the log)", file=sys.stderr)
        return 1
    ours = "cpu_gemm.c" if dtype == torch.float32 else "cpu_gemm_amx.c" if kernel.amx else "cpu_gemm_bf16.c"
    files = resolve_model(args.model)
    hf = AutoConfig.from_pretrained(files.path)
    layers = int(hf.num_hidden_layers)
    gen = torch.Generator().manual_seed(0)
    report = {"model": files.model_id, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
              "dtype": args.dtype, "repeat": args.repeat, "points": []}
    print(f"{files.model_id}  {args.dtype}  one thread  torch {torch.__version__} ({report['cpu']})")
    for rows in args.rows:
        totals = {"F.linear": 0.0, "oneDNN": 0.0, ours: 0.0}
        for name, (n, k) in shapes(hf).items():
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
            x = torch.randn(rows, k, generator=gen).to(dtype)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            if dtype == torch.float32:
                panels = cpu_gemm.pack_panels(w, kernel)
                panel_fn = functools.partial(cpu_gemm.panel_linear, x, panels, n)
            else:
                panels = cpu_gemm.pack_panels_bf16(w, kernel)
                panel_fn = functools.partial(cpu_gemm.panel_linear_bf16, x, panels, (n, k), None)
            impls = {"F.linear": lambda: F.linear(x, w),
                     "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise.default(x, onednn, None, "none", [], ""),
                     ours: panel_fn}
            want = x.double() @ w.double().T
            err = {key: float((fn().double() - want).abs().max()) for key, fn in impls.items()}  # and warm-up
            times: dict[str, list[float]] = {key: [] for key in impls}
            for _ in range(args.repeat):
                for key, fn in impls.items():
                    times[key].append(_thread_ms(fn))
            ms = {key: statistics.median(t) for key, t in times.items()}
            count = 1 if name == "lm_head" else layers
            for key in totals:
                totals[key] += ms[key] * count
            gflops = {key: 2 * rows * n * k / (v * 1e6) for key, v in ms.items()}
            print(f"rows {rows:5d} {name:8s} " + "  ".join(f"{key} {ms[key]:8.3f} ms {gflops[key]:5.1f} GF/s"
                                                        for key in impls)
                  + f"  x{ms['oneDNN'] / ms[ours]:.2f}")
            report["points"].append({"rows": rows, "shape": name, "out": n, "in": k, "ms": ms, "gflops": gflops,
                                     "max_abs_error": err})
        speedup = totals["oneDNN"] / totals[ours]
        print(f"rows {rows:5d} step ({layers} layers + LM head): " + "  ".join(
            f"{key} {v:.1f} ms" for key, v in totals.items()) + f"  {ours} / oneDNN x{speedup:.2f}")
        report["points"].append({"rows": rows, "shape": "step", "ms": totals, "speedup_over_onednn": speedup})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
