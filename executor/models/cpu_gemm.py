"""Linear layers on CPU with the weight packed once, at load time: our float32 and
bfloat16 GEMMs (``cpu_gemm.c``, ``cpu_gemm_bf16.c``) where they build, else oneDNN's.

``F.linear`` on CPU calls MKL's ``sgemm``, which copies the weight into its blocked panel
layout on every call; at decode batch sizes (8-64 rows) that copy takes about as long as
the arithmetic. Packing the weight once removes it. Two packings:

- **float32, one torch thread, an x86 CPU with AVX2 and FMA, a C compiler**: the weight
  in 24-column panels for ``cpu_gemm.c``'s 4 x 24 register-blocked kernel (BLIS's
  structure: Van Zee & van de Geijn, ACM TOMS 2015), called through ``ctypes`` (which
  releases the GIL). On SmolLM2-135M's five weight shapes on one AVX2 core (Zen 3, FMA
  peak 102 GFLOP/s) it reaches 85-94 GFLOP/s from 8 rows up, against oneDNN's 55-80:
  a 32-row decode step's GEMMs 1.41x faster, 8 rows 1.72x, 1 row 1.27x, a 150-token
  prefill 1.22x (``python -m meshserve.bench.cpu_gemm``). Each output is one chain of
  fused multiply-adds over the input features in order, so a row's result never
  depends on the other rows: batch-invariant by construction.
- **bfloat16, one torch thread, a CPU with AVX512-BF16 (Zen 4, Sapphire Rapids and later),
  a C compiler**: the weight in 48-column panels of feature pairs for ``cpu_gemm_bf16.c``'s
  8 x 48 ``vdpbf16ps`` kernel (the same structure; float32 sums, one chain per output, so
  batch-invariant too; the bias added in float32 before the one rounding to bfloat16). On
  SmolLM2-135M's shapes on one Zen 4 core it reaches 176-204 GFLOP/s at 32 rows against
  oneDNN's 139-183 (the peak is ~232): a 32-row decode step's GEMMs 1.14x faster, 8 rows
  1.36x, 1 row 1.40x (the LM head read from memory at 14 GB/s against 9), a 150-token
  prefill 1.05x (``python -m meshserve.bench.cpu_gemm --dtype bfloat16``).
  On a CPU with AMX-BF16 (Sapphire Rapids and later) the same panels are multiplied on AMX
  tiles instead (``cpu_gemm_amx.c``: ``TDPBF16PS`` over blocks of 16 feature pairs, in
  order, so batch-invariant too; two row tiles by a pair of panels a pass): on one Sapphire
  Rapids core, against vLLM's oneDNN matmul on the model's layer shapes, 1.8x at 1 and 32
  rows, 1.05x at 150, 0.82x at 2,048. ``MESHSERVE_CPU_GEMM_AMX=0`` keeps the ``vdpbf16ps``
  kernel there. The AMX kernel also takes SwiGLU's ``gate_up_proj`` packed in groups of 96
  gate and 96 up columns (``cpu_gemm_silu.py``) and writes ``silu(gate) * up`` only, bitwise the
  GEMM then ``cpu_fused.silu_mul``: the 2 x 1,536 gate and up outputs never go to memory and
  back (30 layers at 2,048 rows 219 -> 182 ms, at 32 rows 10.8 -> 9.6;
  ``MESHSERVE_CPU_GEMM_SILU=0`` keeps the two calls).
- **otherwise** (several threads, no compiler, no AVX2/FMA for float32 or no AVX512-BF16 for
  bfloat16, ``MESHSERVE_CPU_GEMM_KERNEL=0``): oneDNN's ``torch.ops.mkldnn._reorder_linear_weight``
  and ``_linear_pointwise``, the ops inductor's CPU weight-prepacking pass emits (15-30%
  faster than ``F.linear`` at 8-256 rows, about 2x on the 49152-row LM head, and
  batch-invariant too). They are private, so ``pack`` checks them on the weight it packs
  and returns ``None`` whenever they are missing, fail or disagree with ``F.linear``; the
  layer then keeps calling ``F.linear``.

The packed copy is held next to the plain weight (which the loaders, the tied embedding
and ``state_dict`` keep using): it costs the weights' size once more in memory. The C
libraries are built once by the system C compiler and cached as the attention kernel is
(``executor.attention.cpu_kernel``).
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from executor import huge_pages
from executor.attention import cpu_kernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemm.c")
SOURCE_BF16 = Path(__file__).with_name("cpu_gemm_bf16.c")
SOURCE_AMX = Path(__file__).with_name("cpu_gemm_amx.c")
AMX_SWITCH = "MESHSERVE_CPU_GEMM_AMX"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
_PACK_BATCH_HINT = 32
"""Rows oneDNN tunes its packed layout for; any number of rows works."""
_lock = threading.Lock()
_PACKED_WEIGHTS = huge_pages.Arena()
"""Where every panel-packed weight of this process lies: a model's weights one after another,
in the order they are packed, on huge pages (``executor.huge_pages.Arena``)."""
_loaded: dict[str, object] = {}


def _bound(fn, restype, *argtypes):
    """``fn`` (a ``ctypes`` function) with its result and argument types set."""
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_BF16_GEMM_SIGNATURE = (ctypes.c_int32, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64)
"""Result and arguments of both bfloat16 GEMMs: (x, m, k, ldx, panels, n, bias, y, ldy)."""


class GemmKernel:
    """``cpu_gemm.c``'s functions (``ctypes``) and its panel width (columns a panel)."""

    def __init__(self, lib: ctypes.CDLL):
        self.pack_weight = _bound(lib.pack_weight, None, _PTR, _I64, _I64, _PTR)
        self.packed_gemm = _bound(lib.packed_gemm, ctypes.c_int32, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64)
        self.panel_width = int(lib.gemm_panel_width())


class GemmKernelBf16:
    """``cpu_gemm_bf16.c``'s functions (``ctypes``) and its panel width.

    Raises:
        AttributeError: the library was built for a CPU without AVX512-BF16 (it then has
            the functions but computes nothing), as for a missing symbol.
    """

    def __init__(self, lib: ctypes.CDLL):
        if not lib.gemm_bf16_available():
            raise AttributeError("the bfloat16 GEMM was built without AVX512-BF16")
        self.pack_weight = _bound(lib.pack_weight_bf16, None, _PTR, _I64, _I64, _PTR)
        self.packed_gemm = _bound(lib.packed_gemm_bf16, *_BF16_GEMM_SIGNATURE)
        self.panel_width = int(lib.gemm_bf16_panel_width())
        self.amx = False  # load_bf16 sets True where packed_gemm is cpu_gemm_amx.c's
        self.packed_gemm_silu = None  # and this to cpu_gemm_amx.c's fused SiLU GEMM (pack_silu_mul)


class GemmKernelAmx:
    """``cpu_gemm_amx.c``'s GEMM on the bfloat16 panels (``ctypes``), its signature
    ``cpu_gemm_bf16.c``'s ``packed_gemm_bf16``.

    Raises:
        AttributeError: Linux refused this process AMX's tile state (``arch_prctl``), or the
            library was built for a CPU without AMX-BF16, as for a missing symbol.
    """

    def __init__(self, lib: ctypes.CDLL):
        if not lib.gemm_amx_available():
            raise AttributeError("AMX tiles unavailable to this process (or the CPU lacks AMX-BF16)")
        self.packed_gemm = _bound(lib.packed_gemm_bf16_amx, *_BF16_GEMM_SIGNATURE)
        self.packed_gemm_silu = _bound(lib.packed_gemm_silu_bf16_amx, ctypes.c_int32, _PTR, _I64, _I64, _I64, _PTR,
                                       _I64, _PTR, _PTR, _PTR, _I64)


def _load_once(key: str, cpu_flags: set[str], lacking: str, label: str, source: Path, bind):
    """``bind(library)`` of the GEMM kernel built from ``source`` (``cpu_kernel.load_once``),
    kept in ``_loaded[key]``; ``None`` where this CPU lacks one of ``cpu_flags``."""
    return cpu_kernel.load_once(_loaded, _lock, key, cpu_flags, lacking, label, source, FLAGS,
                                "MESHSERVE_CPU_GEMM_KERNEL", "oneDNN packed weights", bind)


def load() -> GemmKernel | None:
    """The float32 GEMM kernel, built if needed; ``None`` where it cannot be (not x86 with
    AVX2 and FMA, no compiler, a failed build, ``MESHSERVE_CPU_GEMM_KERNEL=0``). Once per
    process."""
    return _load_once("k", {"avx2", "fma"}, "AVX2 or FMA", "CPU GEMM kernel", SOURCE, GemmKernel)


def load_bf16() -> GemmKernelBf16 | None:
    """The bfloat16 GEMM kernel, built if needed; ``None`` where it cannot be (a CPU without
    AVX512-BF16, no compiler, a failed build, ``MESHSERVE_CPU_GEMM_KERNEL=0``). On a CPU with
    AMX-BF16 its ``packed_gemm`` is ``cpu_gemm_amx.c``'s, on the same panels, unless
    ``MESHSERVE_CPU_GEMM_AMX=0`` or that library cannot be built or given the tiles. Once
    per process."""
    if "bf16 chosen" not in _loaded:
        kernel = _load_once("bf16", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, "AVX512-BF16",
                            "bfloat16 CPU GEMM kernel", SOURCE_BF16, GemmKernelBf16)
        amx = None
        if kernel is not None and os.environ.get(AMX_SWITCH, "1") != "0":
            amx = _load_once("amx", {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"}, "AMX-BF16",
                             "AMX bfloat16 CPU GEMM kernel", SOURCE_AMX, GemmKernelAmx)
        if amx is not None:
            kernel = copy.copy(kernel)
            kernel.packed_gemm, kernel.amx, kernel.packed_gemm_silu = amx.packed_gemm, True, amx.packed_gemm_silu
        _loaded["bf16 chosen"] = kernel
    return _loaded["bf16 chosen"]


def is_panel_packed(packed: torch.Tensor | None) -> bool:
    """Whether ``packed`` came from ``pack_panels`` or ``pack_panels_bf16`` (else oneDNN's
    packing, or None)."""
    return packed is not None and not packed.is_mkldnn and packed.dim() == 3


def pack_panels(weight: torch.Tensor, kernel: GemmKernel) -> torch.Tensor:
    """``weight`` ``(out, in)`` float32 → ``(ceil(out / w), in, w)`` float32 panels of ``w =
    kernel.panel_width`` output columns each (columns past ``out`` zero), 64-byte aligned
    (the kernel's aligned loads), on huge pages where Linux gives them
    (``executor.huge_pages``)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a 2-D float32 CPU weight, not {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    w = kernel.panel_width
    return _packed(weight, kernel, (-(-n // w), k, w))


def pack_panels_bf16(weight: torch.Tensor, kernel: GemmKernelBf16) -> torch.Tensor:
    """``weight`` ``(out, in)`` bfloat16 → ``(ceil(out / w), ceil(in / 2), 2 w)`` bfloat16
    panels of ``w = kernel.panel_width`` output columns, each step of a panel one pair of
    input features for its ``w`` columns (columns past ``out`` and a feature past an odd
    ``in`` zero), 64-byte aligned, on huge pages where Linux gives them."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels_bf16 takes a 2-D bfloat16 CPU weight, not {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    w = kernel.panel_width
    return _packed(weight, kernel, (-(-n // w), -(-k // 2), 2 * w))


def _packed(weight: torch.Tensor, kernel: GemmKernel | GemmKernelBf16, shape: tuple[int, ...]) -> torch.Tensor:
    """A new ``shape`` tensor of ``weight``'s dtype from ``_PACKED_WEIGHTS`` (64-byte aligned
    for the kernels' aligned loads, on huge pages where Linux gives them, next to the
    weight packed before it), filled by ``kernel.pack_weight``."""
    out = _PACKED_WEIGHTS.empty(shape, weight.dtype)
    source = weight.detach().contiguous()  # held for the call: a copy when the weight is strided
    kernel.pack_weight(source.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``weight`` ``(out, in)`` for ``linear``, or ``None`` where the plain
    ``F.linear`` must be used: not a CPU float32/bfloat16 matrix, or neither packing
    available (oneDNN's bfloat16 needs AVX-512 or AVX-NE-CONVERT), or a probe product that
    disagrees with ``F.linear``."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    one_thread = torch.get_num_threads() == 1
    if weight.dtype == torch.float32 and one_thread and (kernel := load()) is not None:
        packed = pack_panels(weight, kernel)
    elif weight.dtype == torch.bfloat16 and one_thread and (kernel_bf16 := load_bf16()) is not None:
        packed = pack_panels_bf16(weight, kernel_bf16)
    elif not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
              and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    else:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        except RuntimeError as err:  # e.g. bfloat16 without AVX-512: oneDNN refuses
            log.debug("oneDNN cannot pack a %s %s weight (%s); using F.linear", tuple(weight.shape), weight.dtype, err)
            return None
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float32,
                        device="cpu").to(weight.dtype)
    try:
        with torch.no_grad():
            got = linear(probe, weight, None, packed).float()
            want = F.linear(probe, weight).float()
    except RuntimeError as err:
        log.debug("the packed %s weight fails a probe (%s); using F.linear", tuple(weight.shape), err)
        return None
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        log.warning("the packed linear disagrees with F.linear on a %s weight; using F.linear", tuple(weight.shape))
        return None
    return packed


def bf16_operands(x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                   what: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
    """``(rows, bias, lead)``: ``x`` ``(..., k)`` as rows of ``k`` features with unit stride,
    ``bias`` ``(n,)`` contiguous, and ``x``'s leading dimensions, once both are checked.

    Raises:
        RuntimeError: ``x`` or ``bias`` is not a bfloat16 CPU tensor of those sizes (``what``
            names the kernel in the message).
    """
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != k:
        raise RuntimeError(f"{what} takes ({k},)-feature bfloat16 CPU input, not {tuple(x.shape)} {x.dtype} on "
                           f"{x.device}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.shape != (n,)):
        raise RuntimeError(f"{what} takes a ({n},) bfloat16 CPU bias, not {tuple(bias.shape)} {bias.dtype}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, bias.contiguous() if bias is not None else None, x.shape[:-1]


def check_panel_shapes(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> None:
    """Raises ``RuntimeError`` unless ``x`` ``(..., in)`` float32 CPU can be multiplied by
    ``packed`` ``(panels, in, w)`` float32 contiguous into ``out_features`` columns: the C
    kernel trusts its sizes, so a mismatch would read past the panels."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1:
        raise RuntimeError(f"the CPU GEMM kernel takes float32 CPU input, not {x.dtype} on {x.device}")
    if (packed.dim() != 3 or packed.dtype != torch.float32 or not packed.is_contiguous()
            or packed.data_ptr() % 32 != 0):
        raise RuntimeError(f"not a panel-packed weight: {tuple(packed.shape)} {packed.dtype}")
    panels, k, width = packed.shape
    if x.shape[-1] != k or not (panels - 1) * width < out_features <= panels * width:
        raise RuntimeError(f"input of {x.shape[-1]} features and {out_features} outputs cannot be multiplied by "
                           f"a packed weight of {k} features and {panels} panels of {width} columns")


def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x W^T`` through ``cpu_gemm.c``: ``x`` ``(..., in)`` float32, ``packed`` from
    ``pack_panels`` → ``(..., out_features)`` float32.

    Raises:
        RuntimeError: ``x`` is not a float32 CPU tensor, or its features or
            ``out_features`` do not match ``packed`` (as ``F.linear`` raises on mismatched
            shapes).
        MemoryError: the kernel's scratch buffer (at most 160 KiB) cannot be allocated.
    """
    check_panel_shapes(x, packed, out_features)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = x2.new_empty(m, out_features)
    if m and load().packed_gemm(x2.data_ptr(), m, k, x2.stride(0), packed.data_ptr(), out_features,
                                y.data_ptr(), out_features) != 0:
        raise MemoryError("the CPU GEMM kernel's scratch buffer")
    return y.view(*lead, out_features)


def panel_linear_bf16(x: torch.Tensor, packed: torch.Tensor, weight_shape: tuple[int, int],
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` through ``cpu_gemm_bf16.c``: ``x`` ``(..., in)`` bfloat16, ``packed``
    from ``pack_panels_bf16`` of a ``weight_shape = (out, in)`` weight, ``bias`` ``(out,)``
    bfloat16 or ``None`` → ``(..., out)`` bfloat16 (float32 sums, rounded once).

    Raises:
        RuntimeError: ``x`` or ``bias`` is not a bfloat16 CPU tensor of the weight's sizes,
            or ``packed`` is not its panels (as ``F.linear`` raises on mismatched shapes).
        MemoryError: the kernel's scratch buffer (384 KiB, more for inputs of over 24,576 features:
            8 rows of them) cannot be allocated.
    """
    n, k = weight_shape
    x2, bias, lead = bf16_operands(x, bias, n, k, "the bfloat16 GEMM kernel")
    kernel = load_bf16()
    w = kernel.panel_width if kernel is not None else 0
    if (kernel is None or packed.dim() != 3 or packed.dtype != torch.bfloat16 or not packed.is_contiguous()
            or packed.data_ptr() % 64 != 0 or tuple(packed.shape) != (-(-n // w), -(-k // 2), 2 * w)):
        raise RuntimeError(f"not the bfloat16 panels of a {n} x {k} weight: {tuple(packed.shape)} {packed.dtype}")
    m = x2.shape[0]
    y = x2.new_empty(m, n)
    if m and kernel.packed_gemm(x2.data_ptr(), m, k, x2.stride(0), packed.data_ptr(), n,
                                bias.data_ptr() if bias is not None else None, y.data_ptr(), n) != 0:
        raise MemoryError("the bfloat16 GEMM kernel's scratch buffer")
    return y.view(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``: ``x`` ``(num_tokens, in)`` → ``(num_tokens, out)``, through ``packed``
    (from ``pack(weight)``) when there is one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if is_panel_packed(packed):
        if x.dtype != packed.dtype:
            return F.linear(x, weight, bias)
        if packed.dtype == torch.bfloat16:  # not traced by torch.compile: its decode step is float32-only
            return panel_linear_bf16(x, packed, tuple(weight.shape), bias)
        if torch.compiler.is_compiling():  # traced by torch.compile: the kernel as an operator
            y = cpu_kernel.TRACED_OPS.panel_linear(x, packed, weight.shape[0])
        else:
            y = panel_linear(x, packed, weight.shape[0])
        return y if bias is None else y.add_(bias)
    if torch.compiler.is_compiling():
        # traced by torch.compile (executor.worker.compiled_decode): inductor's own lowering
        # of this op wants the weight frozen into the graph; called as the aten op instead
        with torch.fx.traceback.annotate({"fallback_to_eager": True}):
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


@torch.library.custom_op("meshserve::panel_linear", mutates_args=())
def _panel_linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return panel_linear(x, packed, out_features)


@_panel_linear_op.register_fake
def _(x, packed, out_features):
    return x.new_empty(*x.shape[:-1], out_features)
