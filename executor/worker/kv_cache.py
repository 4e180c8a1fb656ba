"""Allocating the paged KV cache tensors (their size in blocks is the engine's
choice: ``executor.engine.kv_cache_manager.num_blocks_for_budget``).

Memory layout of one layer (``key_cache`` and ``value_cache`` alike)::

    (num_blocks, block_size, num_kv_heads, head_dim)
      block b, slot s  ->  token at position b_logical * block_size + s of its request

All layers live in one zero-filled allocation (zeros so padded gathers read
finite values), viewed as per-layer K and V tensors; on CPU it is asked for on huge
pages (``executor.huge_pages``: a request's blocks are scattered over it).
"""

from __future__ import annotations

import torch

from executor import huge_pages
from executor.attention import KVCache


def allocate_kv_storage(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The one zero-filled allocation of every layer's K and V:
    ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` of ``dtype``.
    ``storage[:, :, b]`` is block ``b`` of all layers: what the kvstore stores."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        return huge_pages.empty(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_views(storage: torch.Tensor) -> list[KVCache]:
    """One ``(key_cache, value_cache)`` view pair per layer of ``allocate_kv_storage``'s
    tensor, each ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]
