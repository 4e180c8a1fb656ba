"""``VLLM_CPU_OMP_THREADS_BIND=0 V/bin/python meshserve/bench/vllm_gemm.py [--dtype bfloat16] [--rows 1 32 150
2048] [--json FILE]``: vLLM's CPU GEMM against the engine's, in vLLM's own environment (``V``: a venv
with vllm-cpu).

A standalone script (torch and vLLM only; never imported by meshserve): on one thread, for
SmolLM2-135M's weight shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, LM head
49152x576; random weights), it times vLLM's ``ops.onednn_mm`` on a handle from
``ops.create_onednn_mm`` (what vLLM's CPU linear layers call) against the engine's GEMM:

* ``--dtype float32``: ``torch.ops.mkldnn._linear_pointwise`` on a weight from
  ``_reorder_linear_weight`` (the engine's float32 fallback, ``executor/models/cpu_gemm.py``);
* ``--dtype bfloat16``: the engine's own kernel on its panels, built here by gcc from this
  repository's sources with the engine's flags: ``cpu_gemm_bf16.c`` packs the weight,
  ``cpu_gemm_amx.c`` multiplies on a CPU with AMX-BF16 (else ``cpu_gemm_bf16.c``'s
  ``vdpbf16ps`` kernel), called through ``ctypes``.

Each repetition times the two in turn (order alternating), thread CPU time, ``--repeat``
repetitions, medians; one line per shape and row count with both times, the ratio, and the
largest difference of each from a float32 product of the same (rounded) inputs; then the totals
of the 30 layers' four projections (the LM head apart: the engine runs it only on sampled rows).
On a host whose AMX units or memory other tenants share, read ratios from runs in which both
moved together. ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30
MODELS = Path(__file__).resolve().parents[2] / "executor" / "models"
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]  # cpu_gemm.FLAGS
P, I64 = ctypes.c_void_p, ctypes.c_int64


def engine_bf16_gemm(build_dir: str):
    """``(pack, gemm, name)``: the engine's bfloat16 panel packing and GEMM built from this
    repository's C sources (AMX where the CPU and Linux allow it, else ``vdpbf16ps``)."""
    libs = {}
    for stem in ("cpu_gemm_bf16", "cpu_gemm_amx"):
        out = os.path.join(build_dir, stem + ".so")
        subprocess.run(["gcc", *FLAGS, "-o", out, str(MODELS / f"{stem}.c"), "-lm"], check=True)
        libs[stem] = ctypes.CDLL(out)
    pack = libs["cpu_gemm_bf16"].pack_weight_bf16
    pack.restype, pack.argtypes = None, [P, I64, I64, P]
    amx = libs["cpu_gemm_amx"]
    name = "cpu_gemm_amx.c" if amx.gemm_amx_available() else "cpu_gemm_bf16.c"
    gemm = amx.packed_gemm_bf16_amx if name == "cpu_gemm_amx.c" else libs["cpu_gemm_bf16"].packed_gemm_bf16
    gemm.restype, gemm.argtypes = ctypes.c_int32, [P, I64, I64, I64, P, I64, P, P, I64]
    return pack, gemm, name


def panels(pack, w: torch.Tensor) -> torch.Tensor:
    """``w`` (n, k) bfloat16 packed into the engine's panels (48 columns, feature pairs), 64-byte aligned."""
    n, k = w.shape
    size = -(-n // 48) * -(-k // 2) * 96
    buf = torch.empty(size + 32, dtype=torch.bfloat16)
    start = (-buf.data_ptr() % 64) // 2
    out = buf[start:start + size]
    pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32], help="rows of the input (tokens in a step)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops

    dtype = getattr(torch, args.dtype)
    build = tempfile.TemporaryDirectory()
    if dtype == torch.bfloat16:
        pack, gemm, ours = engine_bf16_gemm(build.name)
    else:
        ours = "torch_mkldnn"
    report = {"dtype": args.dtype, "ours": ours, "torch": torch.__version__, "repeat": args.repeat, "points": []}
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        total = {ours: 0.0, "vllm_onednn": 0.0}
        for name, (out_f, in_f) in SHAPES.items():
            w = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(dtype)
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            handle = ops.create_onednn_mm(w.t(), 32)
            if dtype == torch.bfloat16:
                packed, y = panels(pack, w), torch.empty(rows, out_f, dtype=dtype)

                def engine(x=x, packed=packed, y=y, n=out_f, k=in_f, rows=rows):
                    if gemm(x.data_ptr(), rows, k, k, packed.data_ptr(), n, None, y.data_ptr(), n):
                        raise MemoryError("the engine's GEMM could not allocate its padding")
                    return y
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)

                def engine(x=x, packed=packed):
                    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            fns = {ours: engine, "vllm_onednn": lambda x=x, handle=handle: ops.onednn_mm(handle, x, None)}
            want = x.float() @ w.float().t()
            diff = {k: float((fn().float() - want).abs().max()) for k, fn in fns.items()}  # and warm-up
            reps = max(1, min(20, int(2e8 // (rows * out_f * in_f))))  # about 0.2 GFLOP a timing
            times: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(args.repeat):
                for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    start = time.thread_time()
                    for _ in range(reps):
                        fns[k]()
                    times[k].append((time.thread_time() - start) / reps * 1e3)
            ms = {k: statistics.median(v) for k, v in times.items()}
            if name != "lm_head":
                for k in fns:
                    total[k] += ms[k] * LAYERS
            print(f"rows {rows:5d} {name:8s} {ours} {ms[ours]:8.3f} ms  vllm onednn_mm {ms['vllm_onednn']:8.3f} ms"
                  f"  x{ms['vllm_onednn'] / ms[ours]:.2f}  max diff {diff[ours]:.3g} / {diff['vllm_onednn']:.3g}")
            report["points"].append({"rows": rows, "shape": name, "ms": ms, "max_abs_diff": diff})
        print(f"rows {rows:5d} {LAYERS} layers: {ours} {total[ours]:.1f} ms  vllm onednn_mm "
              f"{total['vllm_onednn']:.1f} ms  x{total['vllm_onednn'] / total[ours]:.2f}")
        report["points"].append({"rows": rows, "shape": "layers", "ms": total})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
