"""SwiGLU's gate/up projection and its activation in one pass of the AMX GEMM
(``cpu_gemm_amx.c``'s ``packed_gemm_silu_bf16_amx``): the weight ``[Wg; Wu]`` packed in groups
of ``SILU_GROUP`` gate and as many up columns, each pass writing ``bf16(silu(gate) * up)``
only, bitwise the GEMM on the weight's own panels followed by ``cpu_fused.silu_mul`` (the
same rounding of each gate and up output, the same SiLU table). The 2 x ``inter`` gate and
up outputs of a token then never go to memory and back: the model's 30 ``gate_up`` layers
and their activation at 2,048 rows 219 -> 182 ms, at 32 rows 10.8 -> 9.6 (one Sapphire
Rapids core). ``MergedColumnParallelLinear(..., silu_mul=True)`` (``linear.py``) packs its
weight here where it can; ``MESHSERVE_CPU_GEMM_SILU=0`` keeps the GEMM and ``silu_mul`` apart.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from executor.models import cpu_fused
from executor.models.cpu_gemm import bf16_operands, load_bf16, pack_panels_bf16, panel_linear_bf16

log = logging.getLogger(__name__)

SILU_SWITCH = "MESHSERVE_CPU_GEMM_SILU"
SILU_GROUP = 96
"""Outputs of SiLU(gate) * up a pass of the fused GEMM makes (a panel pair of gate columns
and the pair of up columns for the same outputs: ``pack_silu_mul``)."""


def packing_shape(n: int, k: int) -> tuple[int, int, int]:
    """The shape of ``pack_silu_mul``'s panels of an ``(n, k)`` weight (``n = 2 inter``)."""
    return 4 * -(-(n // 2) // SILU_GROUP), -(-k // 2), SILU_GROUP


def pack_silu_mul(weight: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's stacked ``[gate; up]`` weight ``(2 inter, in)`` bfloat16 packed for
    ``silu_mul_linear_bf16``, which computes ``silu(x Wg^T + bg) * (x Wu^T + bu)`` in one pass
    (the AMX GEMM's ``packed_gemm_silu_bf16_amx``: the gate and up outputs are never written
    out, only their product); ``None`` where that kernel is not to be had (not a bfloat16
    CPU weight of even rows, torch on several threads, no AMX GEMM or fused kernels,
    ``MESHSERVE_CPU_GEMM_SILU=0``) or a probe disagrees with the unfused ops. Its result is
    bitwise the AMX GEMM's ``[gate | up]`` followed by ``cpu_fused.silu_mul``.

    Layout: groups of ``SILU_GROUP`` outputs, group ``q`` the gate rows ``96 q ..`` then the
    up rows ``96 q ..`` (each zero-padded to 96 rows), packed as ``pack_panels_bf16`` packs
    a weight: ``packing_shape``, ``(4 ceil(inter / 96), ceil(in / 2), 96)``."""
    if (weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[0] % 2
            or 0 in weight.shape or torch.get_num_threads() != 1 or os.environ.get(SILU_SWITCH, "1") == "0"):
        return None
    kernel, fused = load_bf16(), cpu_fused.load()
    if kernel is None or kernel.packed_gemm_silu is None or fused is None:
        return None
    inter, k = weight.shape[0] // 2, weight.shape[1]
    groups = -(-inter // SILU_GROUP)
    halves = [F.pad(half.detach(), (0, 0, 0, groups * SILU_GROUP - inter)).view(groups, SILU_GROUP, k)
              for half in weight.split(inter)]
    packed = pack_panels_bf16(torch.stack(halves, dim=1).reshape(2 * groups * SILU_GROUP, k), kernel)
    probe = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        got = silu_mul_linear_bf16(probe, packed, tuple(weight.shape), None).float()
        gate, up = F.linear(probe, weight).float().split(inter, dim=-1)
        want = F.silu(gate) * up
    scale = float(want.abs().nan_to_num(0.0, 0.0, 0.0).max())  # (a weight may hold infinities or NaNs)
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * scale, equal_nan=True):
        log.warning("the fused SiLU GEMM disagrees with the unfused ops on a %s weight; not fused", tuple(weight.shape))
        return None
    return packed


def silu_mul_linear_bf16(x: torch.Tensor, packed: torch.Tensor, weight_shape: tuple[int, int],
                         bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(x Wg^T + bg) * (x Wu^T + bu)``: ``x`` ``(..., in)`` bfloat16, ``packed`` from
    ``pack_silu_mul`` of a ``weight_shape = (2 inter, in)`` weight ``[Wg; Wu]``, ``bias``
    ``(2 inter,)`` bfloat16 ``[bg | bu]`` or ``None`` → ``(..., inter)`` bfloat16, bitwise
    ``cpu_fused.silu_mul`` of ``panel_linear_bf16``'s ``(..., 2 inter)``.

    Raises:
        RuntimeError: ``x`` or ``bias`` is not a bfloat16 CPU tensor of the weight's sizes,
            or ``packed`` is not its packing (as ``F.linear`` raises on mismatched shapes).
        MemoryError: the kernel's padding buffer (16 rows of ``in``) cannot be allocated.
    """
    n, k = weight_shape
    inter = n // 2
    x2, bias, lead = bf16_operands(x, bias, n, k, "the fused SiLU GEMM")
    kernel, fused = load_bf16(), cpu_fused.load()
    if (kernel is None or kernel.packed_gemm_silu is None or fused is None or n % 2 or packed.dim() != 3
            or packed.dtype != torch.bfloat16 or not packed.is_contiguous() or packed.data_ptr() % 64 != 0
            or tuple(packed.shape) != packing_shape(n, k)):
        raise RuntimeError(f"not the fused SiLU packing of a {n} x {k} weight: {tuple(packed.shape)} {packed.dtype}")
    m = x2.shape[0]
    y = x2.new_empty(m, inter)
    if m and kernel.packed_gemm_silu(x2.data_ptr(), m, k, x2.stride(0), packed.data_ptr(), inter,
                                     bias.data_ptr() if bias is not None else None, fused.silu_table, y.data_ptr(),
                                     inter) != 0:
        raise MemoryError("the fused SiLU GEMM's padding buffer")
    return y.view(*lead, inter)


def silu_panels_linear_bf16(x: torch.Tensor, packed: torch.Tensor, weight_shape: tuple[int, int],
                            bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` (``[gate | up]``, not their activation) on ``pack_silu_mul``'s panels of a
    ``weight_shape = (2 inter, in)`` weight: the GEMM over them as they lie (``panel_linear_bf16``,
    the bias laid out alike), the columns then put back in order. Bitwise ``panel_linear_bf16``
    on the weight's own panels (each output column is the same sums wherever its panel lies),
    so a layer packed for the fused GEMM still gives its plain output. Raises as that."""
    n, k = weight_shape
    inter, lead = n // 2, x.shape[:-1]
    groups = -(-inter // SILU_GROUP)
    bf16_operands(x, bias, n, k, "the bfloat16 GEMM kernel")  # (checked against the weight's own sizes)
    if tuple(packed.shape) != packing_shape(n, k) or n % 2:
        raise RuntimeError(f"not the fused SiLU packing of a {n} x {k} weight: {tuple(packed.shape)}")
    if bias is not None:
        bias = torch.stack([F.pad(half, (0, groups * SILU_GROUP - inter)).view(groups, SILU_GROUP)
                            for half in bias.split(inter)], dim=1).reshape(-1)
    y = panel_linear_bf16(x, packed, (2 * groups * SILU_GROUP, k), bias).view(-1, groups, 2, SILU_GROUP)
    return y.transpose(1, 2).reshape(-1, 2, groups * SILU_GROUP)[:, :, :inter].reshape(*lead, n)
