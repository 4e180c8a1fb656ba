"""Rotary position embedding (Su et al., 2021, "RoFormer"), GPT-NeoX layout.

The cosine and sine of every position up to ``max_positions`` are computed once
in float32, exactly as ``transformers`` computes them per call, then looked up by
position once per step (``lookup``) and shared by every layer: rows of the
flattened batch may belong to different requests at different positions.
``transformers`` builds ``cos = cat(freqs, freqs).cos()``, whose two halves are
equal, so only one half is kept, and ``q * cos + rotate_half(q) * sin`` is
computed half by half, in place::

    q1, q2 = q[..., :d/2], q[..., d/2:]
    q1' = q1 * cos - q2 * sin        (= q1 * cos + (-q2) * sin, bit for bit)
    q2' = q2 * cos + q1 * sin

with the same roundings as the reference (one multiply, then one add, per term).

Frequency schedules: ``default``; ``linear``, ``llama3`` and ``yarn`` scaling take
their inverse frequencies from ``transformers``' own ``ROPE_INIT_FUNCTIONS`` so the
numbers match the reference model. Schedules that change with the sequence
length (``dynamic``, ``longrope``) are rejected.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.models import cpu_fused

_STATIC_SCALED = ("linear", "llama3", "yarn")


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(head_dim / 2,)`` float32 and the attention scaling factor.

    Raises:
        ValueError: a rope type whose frequencies depend on the sequence length,
            or a partial rotary factor (not in the Llama family).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim_of(config)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in _STATIC_SCALED:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq.float(), float(scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, {', '.join(_STATIC_SCALED)})")


def head_dim_of(config) -> int:
    """``config.head_dim``, or ``hidden_size / num_attention_heads`` when unset."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """Rotary embeddings for flattened queries and keys.

    Args:
        inv_freq: ``(head_dim / 2,)`` float32 inverse frequencies.
        max_positions: positions ``[0, max_positions)`` are supported (tokens).
        attention_scaling: factor on cos and sin (1.0 except for yarn).
        dtype: dtype of the cached cos/sin (the model's dtype).
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", (freqs.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of ``positions`` ``(num_tokens,)`` int64, each
        ``(num_tokens, 1, head_dim / 2)`` in the model's dtype (once per step).

        Raises:
            IndexError: a position is ``>= max_positions``.
        """
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates ``x`` ``(num_tokens, num_heads, head_dim)`` in place (it may be a view,
        e.g. the query and key heads of a fused QKV output) by ``lookup``'s ``cos``/``sin``.

        float32 or bfloat16 on one CPU thread: one call of the fused C kernel
        (``cpu_fused.py``), bitwise equal to the ops below (in bfloat16 each op rounds
        its result to bfloat16, and so does the kernel, after the same operations)."""
        kernels = cpu_fused.usable(x)
        if kernels is not None and cpu_fused.fits_rotary(x, cos, sin):
            cpu_fused.rotate_(kernels, x, cos, sin)
            return
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated1 = x1 * cos
        rotated1 -= x2 * sin
        x2_cos = x2 * cos
        x2_cos += x1 * sin
        x1.copy_(rotated1)
        x2.copy_(x2_cos)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates ``q`` ``(num_tokens, num_heads, head_dim)`` and ``k``
        ``(num_tokens, num_kv_heads, head_dim)`` by their ``positions`` ``(num_tokens,)``
        int64; returns new tensors of the same shapes and dtype.

        Raises:
            IndexError: a position is ``>= max_positions``.
        """
        cos, sin = self.lookup(positions)
        q, k = q.clone(), k.clone()
        self.rotate_(q, cos, sin)
        self.rotate_(k, cos, sin)
        return q, k
