"""Sizing and allocating the paged KV cache tensors.

Memory layout of one layer (``key_cache`` and ``value_cache`` alike)::

    (num_blocks, block_size, num_kv_heads, head_dim)
      block b, slot s  ->  token at position b_logical * block_size + s of its request

All layers live in one zero-filled allocation (zeros so padded gathers read
finite values), viewed as per-layer K and V tensors.
"""

from __future__ import annotations

import torch

from executor.attention import KVCache


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Blocks that fit ``budget_bytes``.

    Raises:
        ValueError: not even one block fits.
    """
    n = budget_bytes // block_bytes
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes {budget_bytes} is less than one block ({block_bytes} bytes)")
    return n


def allocate_kv_storage(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The one zero-filled allocation of every layer's K and V:
    ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` of ``dtype``.
    ``storage[:, :, b]`` is block ``b`` of all layers: what the kvstore stores."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def layer_views(storage: torch.Tensor) -> list[KVCache]:
    """One ``(key_cache, value_cache)`` view pair per layer of ``allocate_kv_storage``'s
    tensor, each ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str = "cpu") -> list[KVCache]:
    """One ``(key_cache, value_cache)`` pair per layer, each
    ``(num_blocks, block_size, num_kv_heads, head_dim)`` of ``dtype``, zero-filled."""
    return layer_views(allocate_kv_storage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device))
