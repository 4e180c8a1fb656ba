"""``python -m meshserve.bench.cpu_gemm --rows 1 8 32 150 [--repeat 7] [--json FILE]``:
the model's linear layers on one thread through the three CPU GEMMs the engine can use,
interleaved: plain ``F.linear`` (MKL), oneDNN on its packed weight, and ``cpu_gemm.c`` on
its panels (``executor/models/cpu_gemm.py``).

For each ``--rows`` (tokens in a step) and each weight shape of the model (``qkv``,
``o``, ``gate_up``, ``down`` for every layer, the LM head once), random float32 inputs and
weights of that shape; each repetition times every implementation once in turn, by
thread CPU time (the figure to read on a shared host). Reported per shape: median
milliseconds and GFLOP/s of each, and the step's total (layers x the four projections
+ the LM head) with the speed-up of ``cpu_gemm.c`` over oneDNN. The largest difference
from a float64 product is printed too (both packings round within ~1e-5 of it).
"""

from __future__ import annotations

import argparse
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
    if cpu_gemm.load() is None:
        print("the CPU GEMM kernel could not be built here (see the log)", file=sys.stderr)
        return 1
    files = resolve_model(args.model)
    hf = AutoConfig.from_pretrained(files.path)
    layers = int(hf.num_hidden_layers)
    gen = torch.Generator().manual_seed(0)
    report = {"model": files.model_id, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
              "repeat": args.repeat, "points": []}
    print(f"{files.model_id}  float32  one thread  torch {torch.__version__} ({report['cpu']})")
    for rows in args.rows:
        totals = {"F.linear": 0.0, "oneDNN": 0.0, "cpu_gemm.c": 0.0}
        for name, (n, k) in shapes(hf).items():
            w = torch.randn(n, k, generator=gen) * k ** -0.5
            x = torch.randn(rows, k, generator=gen)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            panels = cpu_gemm.pack_panels(w, cpu_gemm.load())
            impls = {"F.linear": lambda: F.linear(x, w),
                     "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise.default(x, onednn, None, "none", [], ""),
                     "cpu_gemm.c": lambda: cpu_gemm.panel_linear(x, panels, n)}
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
                  + f"  x{ms['oneDNN'] / ms['cpu_gemm.c']:.2f}")
            report["points"].append({"rows": rows, "shape": name, "out": n, "in": k, "ms": ms, "gflops": gflops,
                                     "max_abs_error": err})
        speedup = totals["oneDNN"] / totals["cpu_gemm.c"]
        print(f"rows {rows:5d} step ({layers} layers + LM head): " + "  ".join(
            f"{key} {v:.1f} ms" for key, v in totals.items()) + f"  cpu_gemm.c / oneDNN x{speedup:.2f}")
        report["points"].append({"rows": rows, "shape": "step", "ms": totals, "speedup_over_onednn": speedup})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
