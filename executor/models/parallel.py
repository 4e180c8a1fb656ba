"""Tensor-parallel group of this executor: rank, world size, the collectives and
their byte counts.

The parallel layers (``linear.py``, ``embedding.py``) shard their weights by
``rank``/``world_size`` in their ``weight_loader``s and call ``all_reduce`` where
Megatron-LM's scheme needs it (after a row-parallel matmul, after a
vocab-parallel embedding) and ``all_gather_last_dim`` for the LM head's logits
(Shoeybi et al., 2019, "Megatron-LM", section 3). With world size 1 every
collective is the identity; with more, they run over ``torch.distributed``'s
default process group, which ``executor.worker.distributed`` sets up.

Key/value heads: a group larger than the model's KV head count replicates each
KV head on ``world_size / num_kv_heads`` ranks (vLLM's ``num_kv_head_replicas``),
so every rank holds at least one KV head (``kv_heads_per_rank``, ``kv_head_start``).

``COMM`` counts the bytes each collective moved from this rank's point of view
(the payload size, not the algorithm's wire traffic), for the communication
figures of ``meshserve.bench.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommCounter:
    """Bytes and calls of this process's collectives since the last ``reset``.

    Attributes:
        all_reduce_bytes: payload bytes all-reduced (tensor size).
        all_reduce_calls: all-reduce calls.
        all_gather_bytes: bytes this rank contributed to all-gathers.
        p2p_bytes: bytes sent point to point (pipeline activations).
        broadcast_bytes: step inputs broadcast by rank 0 (pickled bytes).
    """

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_bytes: int = 0
    p2p_bytes: int = 0
    broadcast_bytes: int = 0

    def reset(self) -> None:
        self.all_reduce_bytes = self.all_reduce_calls = self.all_gather_bytes = 0
        self.p2p_bytes = self.broadcast_bytes = 0


COMM = CommCounter()


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a model is built for.

    Attributes:
        rank: this process's index in the group, in [0, world_size).
        world_size: number of processes that shard each layer (1: no sharding).
        ranks: the global ranks of the group when it is a subgroup of the process
            group (a pipeline stage's ranks); None: the whole default group. The
            subgroup itself is made after the process group starts (``register_group``).
    """

    rank: int = 0
    world_size: int = 1
    ranks: tuple[int, ...] | None = None

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

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads each rank holds: ``num_kv_heads / world_size``, or 1 when the group is
        larger (each head then replicated on ``world_size / num_kv_heads`` ranks).

        Raises:
            ValueError: neither divides the other.
        """
        if self.world_size <= num_kv_heads:
            return self.shard_size(num_kv_heads, "num_key_value_heads")
        if self.world_size % num_kv_heads:
            raise ValueError(f"the tensor-parallel world size {self.world_size} is larger than num_key_value_heads "
                             f"({num_kv_heads}) and not a multiple of it")
        return 1

    def kv_head_start(self, num_kv_heads: int) -> int:
        """Index of this rank's first KV head in the model's ``num_kv_heads``."""
        if self.world_size <= num_kv_heads:
            return self.rank * self.kv_heads_per_rank(num_kv_heads)
        return self.rank // (self.world_size // num_kv_heads)

    @property
    def group(self):
        """The ``torch.distributed`` group of the collectives (None: the default group)."""
        return None if self.ranks is None else _GROUPS[self.ranks]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group in place; the identity when ``world_size`` is 1."""
        if self.world_size > 1:
            COMM.all_reduce_bytes += x.numel() * x.element_size()
            COMM.all_reduce_calls += 1
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's ``x`` along the last dimension (shape ``(..., n)`` →
        ``(..., n * world_size)``); the identity when ``world_size`` is 1."""
        if self.world_size == 1:
            return x
        COMM.all_gather_bytes += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

_GROUPS: dict[tuple[int, ...], object] = {}


def register_group(ranks: tuple[int, ...], group: object) -> None:
    """Makes ``group`` (``torch.distributed.new_group(ranks)``) the group of every
    ``TensorParallel`` whose ``ranks`` are ``ranks``."""
    _GROUPS[tuple(ranks)] = group


@dataclass(frozen=True)
class PipelineStage:
    """The layers one pipeline stage holds (GPipe-style stages; Huang et al., 2019).

    Attributes:
        stage: this stage's index, in [0, num_stages). Stage 0 also holds the
            embedding, the final norm and the LM head (rank 0 samples).
        num_stages: stages of the pipeline (1: no pipeline).
        num_layers: decoder layers of the whole model.
    """

    stage: int = 0
    num_stages: int = 1
    num_layers: int = 0

    @property
    def layers(self) -> range:
        """This stage's layers: an even split, the first ``num_layers % num_stages``
        stages one layer more."""
        base, extra = divmod(self.num_layers, self.num_stages)
        start = self.stage * base + min(self.stage, extra)
        return range(start, start + base + (self.stage < extra))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1
