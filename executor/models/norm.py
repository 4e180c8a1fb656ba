"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Llama does."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32.

    Matches ``transformers``' ``LlamaRMSNorm`` operation for operation, so float32
    outputs are bitwise equal to the reference.

    Shapes: ``(num_tokens, hidden_size)`` → same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)
