"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Llama does, with the
residual add of the decoder layer folded in (as vLLM's ``fused_add_rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from executor.models import cpu_fused


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32.

    Matches ``transformers``' ``LlamaRMSNorm`` operation for operation (the adds
    and multiplies in place, which rounds the same), so float32 outputs are
    bitwise equal to the reference.

    Shapes: ``(num_tokens, hidden_size)`` → same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``residual += x`` in place (the decoder's skip
        connection, ``residual + x`` in the reference) and returns ``(norm(residual), residual)``.

        float32 or bfloat16 on one CPU thread: one call of the fused C kernel
        (``cpu_fused.py``), which rounds as the ops below."""
        kernels = cpu_fused.usable(x) if x.dim() == 2 and x.is_contiguous() else None
        if kernels is not None and self.weight.dtype == x.dtype and (
                residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)):
            if residual is None:
                return cpu_fused.add_rms_norm(kernels, None, x, self.weight, self.eps)
            return cpu_fused.add_rms_norm(kernels, x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        residual += x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        out = x32 * variance.add_(self.eps).rsqrt_()
        if dtype != torch.float32:
            out = out.to(dtype)
        return out.mul_(self.weight)
