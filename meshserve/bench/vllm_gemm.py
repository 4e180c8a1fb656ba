"""``VLLM_CPU_OMP_THREADS_BIND=0 V/bin/python meshserve/bench/vllm_gemm.py [--rows 32]``: vLLM's
CPU GEMM against the engine's, in vLLM's own environment (``V``: a venv with vllm-cpu).

A standalone script (torch and vLLM only; never imported by meshserve): on one
thread, for SmolLM2-135M's weight shapes (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, LM head 49152x576; random float32 weights), it times
vLLM's ``ops.onednn_mm`` on a handle from ``ops.create_onednn_mm`` (vLLM's float32
linear on CPU) against ``torch.ops.mkldnn._linear_pointwise`` on a weight from
``_reorder_linear_weight`` (the engine's, ``executor/models/cpu_gemm.py``),
interleaved, thread CPU time, medians of 7; then a decode step's total (30 layers
of the four projections plus the LM head). Prints one line per shape and the
totals; the largest difference of vLLM's product from ``x @ w.T`` beside each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows of the input (the decode batch)")
    rows = parser.parse_args().rows
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops

    total = {"torch_mkldnn": 0.0, "vllm_onednn": 0.0}
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) * 0.05
        x = torch.randn(rows, in_f)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        handle = ops.create_onednn_mm(w.t(), 32)
        fns = {"torch_mkldnn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
               "vllm_onednn": lambda: ops.onednn_mm(handle, x, None)}
        reps = 3 if name == "lm_head" else 20
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(7):
            for k, fn in fns.items():
                start = time.thread_time()
                for _ in range(reps):
                    fn()
                times[k].append((time.thread_time() - start) / reps * 1e3)
        for k in fns:
            total[k] += statistics.median(times[k]) * (1 if name == "lm_head" else LAYERS)
        diff = float((fns["vllm_onednn"]() - x @ w.t()).abs().max())
        print(rows, name, {k: round(statistics.median(v), 3) for k, v in times.items()}, "max diff", diff)
    print("a decode step (30 layers + head), thread-CPU ms:", {k: round(v, 1) for k, v in total.items()})


if __name__ == "__main__":
    main()
