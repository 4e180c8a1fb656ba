"""The attention layer a model holds: head geometry, its KV cache, its backend."""

from __future__ import annotations

import torch
from torch import nn

from executor.attention.backend import AttentionBackend, KVCache
from executor.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged causal attention of one decoder layer.

    The ModelRunner binds ``kv_cache`` (this layer's key and value caches, each
    ``(num_blocks, block_size, num_kv_heads, head_dim)``) after allocating it; the
    backend is shared by all layers.

    Args:
        num_heads: query heads (on this rank).
        num_kv_heads: key/value heads (on this rank); divides ``num_heads``.
        head_dim: features per head.
        scale: softmax scale.
        backend: the attention backend.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache: KVCache | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``q`` ``(num_tokens, num_heads, head_dim)``, ``k``/``v`` ``(num_tokens, num_kv_heads,
        head_dim)`` → ``(num_tokens, num_heads * head_dim)``.

        Raises:
            RuntimeError: no KV cache is bound.
        """
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound")
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
