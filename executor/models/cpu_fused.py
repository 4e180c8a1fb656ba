"""Fused CPU kernels for the decoder layer's elementwise work (``cpu_fused.c``):
the residual add with RMSNorm, the rotary embedding of the query and key heads, and
SwiGLU's SiLU-and-multiply, each in float32 and in bfloat16.

Why: at decode batch sizes (8-64 rows of 576 features for SmolLM2-135M) each torch op
costs more in dispatch and fresh tensors than in arithmetic. The torch RMSNorm with
its residual add is seven ops (add, pow, mean, add, rsqrt, mul, mul; in bfloat16 two
casts more) and the rotary five plus two copies, SiLU-and-multiply a split, a fresh
tensor and two ops; each kernel here is one ``ctypes`` call, one pass over the rows,
no temporary tensors (``python -m meshserve.bench.step_profile`` counts them under
``norm/elementwise`` and ``model python``). On a CPU with native bfloat16 (AVX512-BF16,
AMX) the GEMMs run 2-4x faster in bfloat16, so there this work is a larger part of a
bfloat16 step.

Numbers: the kernels compute what the torch ops compute, rounding where they round
(the C is compiled with ``-ffp-contract=off`` and without ``-ffast-math``, so every
product and sum is rounded as written). bfloat16 values are widened to float32 and
rounded back to nearest even after each operation that the torch op performing it
rounds: ``residual += x`` rounds the sum, the norm's output is rounded before and after
its product with the weight, each rotary product and sum is rounded, SiLU is rounded
before its product with up. Measured against the torch ops of ``norm.py``,
``rotary.py`` and ``LlamaMLP`` (``tests/executor/test_cpu_fused_kernels.py``):

- rotary, float32 and bfloat16: bitwise.
- RMSNorm with the residual add, float32 and bfloat16: bitwise. The statistic
  ``mean(x^2)`` is summed in float32 in the order of torch's own CPU sum (ATen's
  cascade sum over vectors of ``sum_lanes`` floats, ``mean_of_squares`` in the C: 8
  on AVX2 and on AVX-512 CPUs alike with torch 2.13, measured at load); a torch that
  sums in neither order would leave the statistic within its last bit (then a rare
  output one or two bfloat16 ulps off; ``norm_bitwise`` false, logged).
- SiLU-and-multiply: e^x is Cephes' polynomial (within 2 float32 ulp; torch's Sleef
  within 1), so in float32 a product may differ from torch's in its last bits; in
  bfloat16 the SiLU rounded to bfloat16 can differ by one ulp where the float32 value
  lies next to a rounding boundary: over all 65,280 finite bfloat16 gates, none does
  against torch 2.13's AVX2 exponential. (In bfloat16 the rounded SiLU of each of the
  65,536 gates is computed once, when the library loads, and looked up: 2x faster, the
  same bits.)

The C is compiled with ``-ffinite-math-only -fno-trapping-math`` too, which lets the
compiler vectorise the clamps of that exponential; activations are finite.

Used only for float32 and bfloat16 CPU tensors while torch runs one thread (as the
attention kernel; more threads: torch, which parallelises). Built once by the system C
compiler and cached as the attention kernel is (``executor.attention.cpu_kernel``);
``MESHSERVE_CPU_FUSED_KERNELS=0`` turns them off, and where no compiler works the
torch ops stay.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from executor.attention import cpu_kernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-ffinite-math-only",
         "-fPIC", "-shared", "-std=c11")
DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels take."""
_lock = threading.Lock()
_loaded: dict[str, object] = {}


@dataclass(frozen=True)
class FusedKernels:
    """The library's functions (``ctypes``): float32, then bfloat16; ``lanes``, the float32
    vector width of torch's sum here (``sum_lanes``), and ``norm_bitwise``: whether that
    order was found (the norm then rounds bitwise as torch's ops)."""

    add_rms_norm: object
    rotary_inplace: object
    silu_mul: object
    add_rms_norm_bf16: object
    rotary_inplace_bf16: object
    silu_mul_bf16: object
    lanes: int = 8
    norm_bitwise: bool = True
    silu_table: int = 0
    """The address of the library's ``silu_bf16_table`` (bf16(silu(g)) for every bfloat16
    gate g, 65,536 float32), which ``silu_mul_bf16`` and the AMX GEMM's fused SiLU read."""


_UNSET = object()


def sum_lanes(kernels: FusedKernels) -> int | None:
    """Floats per vector of torch's float32 sum on this host: the order the norm's
    statistic must follow (``mean_of_squares`` in ``cpu_fused.c``), 8 or 16.

    Measured, not inferred from the CPU: torch dispatches its reductions to AVX2 code
    (8 lanes) on most AVX-512 CPUs too (torch 2.13 on a Zen 4 core: 16-lane sums left
    most float32 rows a unit in the last place off), and other builds may not. The
    kernel's norm of probe rows (random, sizes 96 and 576: both orders differ there)
    is compared with torch's; None where neither order matches (logged)."""
    gen = torch.Generator().manual_seed(0)
    # float32 on the CPU whatever the process's default dtype and device: the kernel reads and
    # writes float32 through raw pointers (bfloat16 rows were overrun, meta ones were null)
    f32 = {"dtype": torch.float32, "device": "cpu", "generator": gen}
    weight_of = {hidden: torch.randn(hidden, **f32) for hidden in (96, 576)}
    rows_of = {hidden: torch.randn(8, hidden, **f32) * 3 for hidden in weight_of}
    for lanes in (8, 16):
        probe = replace(kernels, lanes=lanes)
        if all(torch.equal(_call_norm(probe, rows_of[h].clone(), weight_of[h], 1e-5),
                           _torch_norm(rows_of[h], weight_of[h], 1e-5)) for h in weight_of):
            return lanes
    log.warning("the fused RMSNorm matches torch's float32 sum in neither 8- nor 16-float order here; its "
                "statistic may differ from torch's in the last bit")
    return None


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm.RMSNorm._norm`` in float32 (the reference the probe matches; norm.py imports
    this module, so it is not imported from there)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return (x * variance.add_(eps).rsqrt_()).mul_(weight)


def _call_norm(k: FusedKernels, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The float32 kernel itself (not ``add_rms_norm``, which callers may wrap)."""
    out = torch.empty_like(residual)
    k.add_rms_norm(None, residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual.shape[0],
                   residual.shape[1], eps, k.lanes)
    return out


TRACED = FusedKernels(None, None, None, None, None, None)
"""What ``usable`` returns while ``torch.compile`` traces: the custom ops stand in."""


def load() -> FusedKernels | None:
    """The kernels, built if needed; ``None`` where they cannot be (no compiler, a failed
    build, or ``MESHSERVE_CPU_FUSED_KERNELS=0``). Once per process."""
    kernels = _loaded.get("k", _UNSET)  # the hot path: no lock once loaded
    if kernels is not _UNSET:
        return kernels
    with _lock:
        if "k" not in _loaded:
            _loaded["k"] = cpu_kernel.build_and_load("fused CPU kernels", SOURCE, FLAGS, "MESHSERVE_CPU_FUSED_KERNELS",
                                                     "torch norms and rotary", _bind)
        return _loaded["k"]


def _bind(lib: ctypes.CDLL) -> FusedKernels:
    functions = []
    for suffix in ("", "_bf16"):  # float32, then bfloat16: the same signatures
        norm = getattr(lib, "add_rms_norm" + suffix)
        rotary = getattr(lib, "rotary_inplace" + suffix)
        silu = getattr(lib, "silu_mul" + suffix)
        norm.restype = rotary.restype = silu.restype = None
        norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int32]
        rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
        silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        functions += [norm, rotary, silu]
    kernels = FusedKernels(*functions)
    lanes = sum_lanes(kernels)
    lib.silu_bf16_table_address.restype = ctypes.c_void_p
    return replace(kernels, lanes=lanes or 8, norm_bitwise=lanes is not None,
                   silu_table=lib.silu_bf16_table_address())


def usable(x: torch.Tensor) -> FusedKernels | None:
    """The kernels when ``x`` is a float32 or bfloat16 CPU tensor and torch runs one
    thread, else None. The other tensors of a call must have ``x``'s dtype.

    While ``torch.compile`` traces the model (``executor.worker.compiled_decode``, which is
    only built where ``load()`` works and torch runs one thread) it returns a placeholder
    and the functions below record the custom ops at the end of this file instead of
    ``ctypes`` calls, which the tracer cannot follow."""
    if torch.compiler.is_compiling():
        return TRACED if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if x.device.type != "cpu" or x.dtype not in DTYPES or torch.get_num_threads() != 1:
        return None
    return load()


def add_rms_norm(k: FusedKernels, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place (no add when ``x`` is None), then RMSNorm of ``residual``
    times ``weight``: ``(n, hidden)`` float32 or bfloat16 contiguous (``x``, ``weight`` of
    the same dtype) → a new ``(n, hidden)`` tensor."""
    if k is TRACED:  # usable() said torch.compile is tracing
        if x is None:
            return cpu_kernel.TRACED_OPS.rms_norm(residual, weight, eps)
        return cpu_kernel.TRACED_OPS.add_rms_norm(x, residual, weight, eps)
    n, hidden = residual.shape
    out = torch.empty_like(residual)
    if x is not None:
        x = x.contiguous()
    kernel = k.add_rms_norm_bf16 if residual.dtype == torch.bfloat16 else k.add_rms_norm
    kernel(None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
           n, hidden, eps, k.lanes)
    return out


def rotate_(k: FusedKernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``x`` ``(n, heads, head_dim)`` in place, a view whose heads are contiguous
    (``x.stride() == (row_stride, head_dim, 1)``, e.g. the query and key heads of a fused
    QKV output); ``cos``, ``sin`` ``(n, 1, head_dim / 2)`` contiguous, of ``x``'s dtype
    (float32 or bfloat16)."""
    if k is TRACED:
        cpu_kernel.TRACED_OPS.rotary_(x, cos, sin)
        return
    n, heads, head_dim = x.shape
    kernel = k.rotary_inplace_bf16 if x.dtype == torch.bfloat16 else k.rotary_inplace
    kernel(x.data_ptr(), x.stride(0), n, heads, head_dim, cos.data_ptr(), sin.data_ptr())


def silu_mul(k: FusedKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``(n, 2 * inter)`` float32 or bfloat16 contiguous
    (gate then up) → a new ``(n, inter)`` tensor of its dtype."""
    if k is TRACED:
        return cpu_kernel.TRACED_OPS.silu_mul(gate_up)
    n, two_inter = gate_up.shape
    out = gate_up.new_empty(n, two_inter // 2)
    kernel = k.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else k.silu_mul
    kernel(gate_up.data_ptr(), out.data_ptr(), n, two_inter // 2)
    return out


def fits_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotate_`` can run on these (layouts as its docstring says)."""
    return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous()
            and sin.is_contiguous() and cos.dtype == x.dtype and sin.dtype == x.dtype
            and cos.numel() == x.shape[0] * x.shape[2] // 2)


# The kernels as torch custom ops, so that ``torch.compile`` keeps them in one graph (a
# ``ctypes`` call would break it): opaque to the compiler, with fake implementations
# that give the output's shape. Their real implementations are the functions above.

@torch.library.custom_op("meshserve::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(load(), None, x, weight, eps)


@torch.library.custom_op("meshserve::add_rms_norm", mutates_args=("residual",))
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(load(), x, residual, weight, eps)


@torch.library.custom_op("meshserve::rotary_", mutates_args=("x",))
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rotate_(load(), x, cos, sin)


@torch.library.custom_op("meshserve::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(load(), gate_up)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(residual)


@_rotary_op.register_fake
def _(x, cos, sin):
    return None


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
