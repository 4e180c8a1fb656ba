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
"""

from __future__ import annotations

from typing import Sequence

import torch


class KVConnectorWorker:
    """Copies whole blocks between payload bytes and the one KV cache allocation.

    Args:
        kv_storage: ``executor.worker.kv_cache.allocate_kv_storage``'s tensor,
            ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``.
    """

    def __init__(self, kv_storage: torch.Tensor):
        self.kv_storage = kv_storage
        shape = kv_storage.shape
        self.block_shape = (shape[0], shape[1], *shape[3:])  # (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.block_bytes = kv_storage[:, :, 0].numel() * kv_storage.element_size()

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
            self.kv_storage[:, :, block_id].copy_(kv)

    def save_kv(self, block_ids: Sequence[int]) -> list[bytes]:
        """The payloads of ``block_ids`` (after the forward pass that computed them),
        in order: one gather to the CPU, then one ``bytes`` per block."""
        if not block_ids:
            return []
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_storage.device)
        blocks = self.kv_storage.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        raw = blocks.view(len(block_ids), -1).view(torch.uint8)
        return [row.numpy().tobytes() for row in raw]
