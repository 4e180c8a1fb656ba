"""The worker's half of KV transfer: block bytes into and out of the paged KV cache.

The engine's half (``executor.engine.kv_connector.KVConnectorScheduler``) decides
which blocks to load and which to save; the decisions reach the worker in the
step's ``SchedulerOutput`` as plain data and the bytes come back in its
``ModelRunnerOutput``, so this half knows nothing of requests, hashes or the
kvstore (vLLM v1's worker-side connector: ``start_load_kv`` before the forward
pass, ``save_kv_layer`` after it)::

    SchedulerOutput.kv_loads  [(block_id, payload)] ──▶ load_kv   ──▶ storage[:, :, block_id]
    forward pass
    SchedulerOutput.kv_saves  [BlockSave(block_id)] ──▶ save_kv   ──▶ ModelRunnerOutput.kv_saved [payload]

A payload is the raw bytes of one block of every layer: a contiguous
``(num_layers, 2, block_size, num_kv_heads, head_dim)`` tensor in the cache
dtype (``meshserve.block_hash.KVLayout``), exactly what the kvstore stores.

In a tensor- or pipeline-parallel group a rank's cache holds only some heads
(``kv_heads``) of some layers (``layers``). Payloads stay whole-model blocks:
each rank loads its part of a payload (``load_kv``), and the group reassembles a
saved block from every rank's part (``save_local`` on each rank,
``assemble_blocks`` on rank 0), so the kvstore's blocks do not depend on the
parallel layout and executors of different layouts share them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class KVConnectorWorker:
    """Copies whole blocks between payload bytes and the one KV cache allocation.

    Args:
        kv_storage: ``executor.worker.kv_cache.allocate_kv_storage``'s tensor,
            ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` (this
            rank's layers and heads).
        layers: this rank's layers ``(start, total)`` in the model (default: all).
        kv_heads: this rank's KV heads ``(start, total)`` in the model (default: all).
    """

    def __init__(self, kv_storage: torch.Tensor, layers: tuple[int, int] | None = None,
                 kv_heads: tuple[int, int] | None = None):
        self.kv_storage = kv_storage
        shape = kv_storage.shape
        self.layer_start, num_layers = layers or (0, shape[0])
        self.head_start, num_heads = kv_heads or (0, shape[4])
        # a whole-model payload: (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.block_shape = (num_layers, shape[1], shape[3], num_heads, shape[5])
        self.block_bytes = math.prod(self.block_shape) * kv_storage.element_size()
        self.whole = tuple(self.block_shape) == (shape[0], shape[1], *shape[3:])

    def load_kv(self, loads: Sequence[tuple[int, bytes | bytearray]]) -> None:
        """Copies fetched payloads into their blocks (before the forward pass).

        Args:
            loads: ``(block_id, payload)``; ``payload`` holds one ``block_shape``
                tensor in the cache dtype (a ``bytearray`` is used in place, read-only
                bytes are copied once).

        Raises:
            ValueError: a payload has the wrong size (the connector checks sizes first).
        """
        for block_id, payload in loads:
            if len(payload) != self.block_bytes:
                raise ValueError(f"payload of {len(payload)} bytes does not fit a block of shape {self.block_shape}")
            buffer = payload if isinstance(payload, bytearray) else bytearray(payload)
            kv = torch.frombuffer(buffer, dtype=self.kv_storage.dtype).view(self.block_shape)
            if not self.whole:  # this rank's layers and heads of the payload
                local = self.kv_storage.shape
                kv = kv[self.layer_start:self.layer_start + local[0], :, :,
                        self.head_start:self.head_start + local[4]]
            self.kv_storage[:, :, block_id].copy_(kv)

    def save_kv(self, block_ids: Sequence[int]) -> list[bytes]:
        """The payloads of ``block_ids`` (after the forward pass that computed them),
        in order: one gather to the CPU, then one ``bytes`` per block."""
        if not block_ids:
            return []
        return block_payloads(self.save_local(block_ids))

    def save_local(self, block_ids: Sequence[int], to_cpu: bool = True) -> torch.Tensor:
        """This rank's part of the blocks ``block_ids``: a contiguous tensor
        ``(len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim)`` of its
        layers and heads, on the CPU (``to_cpu``) or the cache's device."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_storage.device)
        local = self.kv_storage.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        return local.cpu() if to_cpu else local


def block_payloads(blocks: torch.Tensor) -> list[bytes]:
    """One payload per block of a ``(n, num_layers, 2, block_size, num_kv_heads, head_dim)``
    tensor holding whole-model blocks."""
    raw = blocks.contiguous().view(blocks.shape[0], -1).view(torch.uint8)
    return [row.numpy().tobytes() for row in raw]


def assemble_blocks(parts: Sequence[torch.Tensor], layer_starts: Sequence[int],
                    head_starts: Sequence[int]) -> torch.Tensor:
    """Whole-model blocks from the ranks' ``save_local`` parts.

    Args:
        parts: each rank's ``(n, its_layers, 2, block_size, its_heads, head_dim)`` part.
        layer_starts, head_starts: where each part's first layer and head sit in the
            model. Replicated KV heads (several ranks with one start) are taken once.

    Returns:
        ``(n, num_layers, 2, block_size, num_kv_heads, head_dim)``.
    """
    num_layers = max(start + p.shape[1] for p, start in zip(parts, layer_starts))
    num_heads = max(start + p.shape[4] for p, start in zip(parts, head_starts))
    n, _, two, block_size, _, head_dim = parts[0].shape
    out = parts[0].new_empty(n, num_layers, two, block_size, num_heads, head_dim)
    for part, layer, head in zip(parts, layer_starts, head_starts):
        out[:, layer:layer + part.shape[1], :, :, head:head + part.shape[4]] = part
    return out
