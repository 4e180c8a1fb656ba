"""Which dtype ``--dtype auto`` runs in on a CPU: the faster of float32 and bfloat16.

Two steps:

1. **CPU features.** Without AVX512-BF16 or AMX-BF16 (``cpu_has_native_bf16``),
   torch's bfloat16 matmuls fall back to generic code (on one AVX2 core a
   SmolLM2-135M decode step at 32 requests takes 3.7x as long in bfloat16 as in
   float32, a 512-token prefill 5.7x): float32, no measuring.
2. **A measured probe** where the CPU has native bfloat16: the model's two MLP
   matmuls (``gate_up_proj`` ``(2 * intermediate, hidden)`` and ``down_proj``
   ``(hidden, intermediate)``, random weights, packed as the model packs them,
   ``cpu_gemm.py``) on 32 and 256 rows, both dtypes interleaved, median of 5
   after a warm-up. bfloat16 is chosen only when its matmuls take at most
   ``BF16_MARGIN`` of float32's time: the rest of a bfloat16 step (norms and
   rotary computed in float32, conversions) costs more than in float32, so
   matmuls that are merely as fast do not make the step faster. On a CPU with
   native bfloat16 where the engine's bfloat16 step was 0.63x its float32 step,
   ``auto`` must not pick it.

The choice and its reason are logged (``INFO``) and returned as a ``DtypeChoice``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BF16_MARGIN = 0.8
"""bfloat16 is picked when its probe matmuls take at most this fraction of float32's."""


@dataclass(frozen=True)
class DtypeChoice:
    """``auto``'s dtype on a CPU and why.

    Attributes:
        dtype: float32 or bfloat16.
        reason: one line for the log.
        float32_ms / bfloat16_ms: the probe's medians (milliseconds), None when not measured.
    """

    dtype: torch.dtype
    reason: str
    float32_ms: float | None = None
    bfloat16_ms: float | None = None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16)."""
    # torch.backends.cpu.get_cpu_capability() names the vector width only ("AVX2",
    # "AVX512"), not bfloat16 support; torch.cpu's private probe (cpuinfo) does, and
    # every AMX CPU so far also has AVX512-BF16.
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and probe():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def probe_matmul_ms(hidden: int, intermediate: int, repeat: int = 5) -> tuple[float, float]:
    """Median milliseconds of the MLP matmuls (see the module doc) in float32 and in
    bfloat16, interleaved: ``(float32_ms, bfloat16_ms)``."""
    from executor.models import cpu_gemm

    gen = torch.Generator().manual_seed(0)
    shapes = [(2 * intermediate, hidden), (hidden, intermediate)]
    weights = [torch.randn(shape, generator=gen) * 0.02 for shape in shapes]
    inputs = {rows: [torch.randn(rows, shape[1], generator=gen) for shape in shapes] for rows in (32, 256)}
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [w.to(dtype) for w in weights]
        cases[dtype] = (ws, [cpu_gemm.pack(w) for w in ws],
                        {rows: [x.to(dtype) for x in xs] for rows, xs in inputs.items()})

    def once(dtype: torch.dtype) -> float:
        ws, packed, xs = cases[dtype]
        start = time.perf_counter()
        for rows in xs:
            for w, p, x in zip(ws, packed, xs[rows]):
                cpu_gemm.linear(x, w, None, p)
        return time.perf_counter() - start

    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    with torch.inference_mode():
        for dtype in times:
            once(dtype)  # warm-up
        for _ in range(repeat):
            for dtype in times:
                times[dtype].append(once(dtype))
    return (statistics.median(times[torch.float32]) * 1e3, statistics.median(times[torch.bfloat16]) * 1e3)


@functools.lru_cache(maxsize=8)
def choose_cpu_dtype(hidden: int, intermediate: int) -> DtypeChoice:
    """``auto``'s dtype on this CPU for a model of these sizes (measured once a process)."""
    if not cpu_has_native_bf16():
        choice = DtypeChoice(torch.float32, "float32: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)")
    else:
        f32, bf16 = probe_matmul_ms(hidden, intermediate)
        if bf16 <= BF16_MARGIN * f32:
            choice = DtypeChoice(torch.bfloat16, f"bfloat16: native bfloat16, its probe matmuls took {bf16:.2f} ms "
                                 f"against {f32:.2f} ms in float32", f32, bf16)
        else:
            choice = DtypeChoice(torch.float32, f"float32: native bfloat16, but its probe matmuls took {bf16:.2f} ms "
                                 f"against {f32:.2f} ms in float32 (bfloat16 needs <= {BF16_MARGIN:g}x)", f32, bf16)
    log.info("dtype auto on CPU → %s", choice.reason)
    return choice
