"""The attention backend interface.

A backend does two things per step: ``plan`` (once, after the ModelRunner built
the ``AttentionMetadata``: precompute gather indices, masks, kernel work lists)
and ``forward`` (once per layer: write this step's K/V into the paged cache, then
attend). The backends and their registry by name: ``executor.attention.registry``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from executor.attention.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's ``(key_cache, value_cache)``, each ``(num_blocks, block_size,
num_kv_heads, head_dim)`` in the model's dtype."""


class AttentionBackend(ABC):
    """Paged causal attention over a flattened, unpadded batch."""

    name: ClassVar[str]  # the registry's name for it
    supports_cuda_graphs: ClassVar[bool] = False  # has ``plan_static_decode`` (``executor.worker.cuda_graphs``)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precomputes per-step data into ``metadata.plan`` (default: nothing)."""

    def plan_static_decode(self, metadata: AttentionMetadata, max_seq_len: int) -> None:
        """A plan for a pure-decode batch that holds for any ``seq_lens`` up to
        ``max_seq_len`` (tokens): made once, it is reused by every step replayed in a
        CUDA graph, so it may read no per-step host value (``seq_lens_cpu``…).

        Raises:
            NotImplementedError: the backend's plan depends on the step's data
                (``supports_cuda_graphs`` is False).
        """
        raise NotImplementedError(f"the {self.name} attention backend has no data-independent decode plan")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Writes ``k``/``v`` into ``kv_cache`` at ``metadata.slot_mapping`` and attends.

        Args:
            q: ``(num_tokens, num_heads, head_dim)``.
            k, v: ``(num_tokens, num_kv_heads, head_dim)``; ``num_heads`` must be a
                multiple of ``num_kv_heads`` (grouped-query attention).
            kv_cache: this layer's paged cache (written in place).
            metadata: the step's metadata, after ``plan``.
            scale: softmax scale (usually ``head_dim ** -0.5``).

        Returns:
            ``(num_tokens, num_heads, head_dim)``, the dtype of ``q``.
        """
