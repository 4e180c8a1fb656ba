"""Vocab-parallel token embedding and LM head (Megatron-LM's vocabulary split).

The vocabulary is padded up to a multiple of ``world_size`` and each rank holds
one contiguous slice of rows. The embedding zeroes ids outside its slice and
all-reduces; the LM head computes its slice of the logits and all-gathers them.
With ``world_size`` 1 both are a plain lookup and a plain matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.models import cpu_gemm
from executor.models.checkpoint import attach_weight_loader, materialize
from executor.models.parallel import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Token embedding sharded along the vocabulary.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.

    Shapes: ``input_ids`` ``(num_tokens,)`` int64 → ``(num_tokens, embedding_dim)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel = SINGLE,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        padded = -(-num_embeddings // tp.world_size) * tp.world_size
        self.rows_per_rank = padded // tp.world_size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim, dtype=dtype), requires_grad=False)
        attach_weight_loader(self.weight, self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's rows of the full ``(vocab, hidden)`` matrix (padding rows stay 0)."""
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not fit "
                             f"({self.num_embeddings}, {param.shape[1]})")
        rows = loaded[self.vocab_start:self.vocab_start + self.rows_per_rank]
        param.data[: rows.shape[0]].copy_(materialize(rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, sharded like the embedding (and
    sharing its weight when the checkpoint ties them).

    Shapes: ``hidden`` ``(num_reqs, hidden)`` → logits ``(num_reqs, vocab_size)``.
    """

    packed_weight: torch.Tensor | None = None  # cpu_gemm.pack(weight), once loaded

    def process_weights_after_loading(self) -> None:
        """Packs the loaded (possibly tied) weight for the CPU GEMM; the embedding
        lookup keeps reading the plain weight."""
        self.packed_weight = cpu_gemm.pack(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(cpu_gemm.linear(hidden, self.weight, None, self.packed_weight))
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied with compute_logits()")
