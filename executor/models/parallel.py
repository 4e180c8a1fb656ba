"""Tensor-parallel group of this executor: rank, world size and the all-reduce.

World size is 1 today. The parallel layers (``linear.py``, ``embedding.py``)
already shard their weights by ``rank``/``world_size`` in their
``weight_loader``s and call ``all_reduce`` where Megatron-LM's scheme needs it
(after a row-parallel matmul, after a vocab-parallel embedding), so running the
model over a ``torch.distributed`` group later needs no model rewrite
(Shoeybi et al., 2019, "Megatron-LM", section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a model is built for.

    Attributes:
        rank: this process's index in the group, in [0, world_size).
        world_size: number of processes that shard each layer (1: no sharding).
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad tensor-parallel group: rank {self.rank}, world_size {self.world_size}")

    def shard_size(self, total: int, what: str) -> int:
        """``total / world_size``.

        Raises:
            ValueError: ``total`` does not split evenly (``what`` names the dimension).
        """
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel world size {self.world_size}")
        return total // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group in place; the identity when ``world_size`` is 1."""
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's ``x`` along the last dimension (shape ``(..., n)`` →
        ``(..., n * world_size)``); the identity when ``world_size`` is 1."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
