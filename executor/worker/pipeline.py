"""PipelineModelRunner: one step's forward pass as micro-batches over pipeline stages.

The model's layers are split into stages (``executor.models.parallel.PipelineStage``);
each stage is ``tensor_parallel_size`` ranks, rank ``stage * T + t``. Stage 0 also
holds the embedding, the final norm and the LM head, so rank 0 both starts and
finishes every micro-batch and samples (GPipe's micro-batches, Huang et al., 2019;
like vLLM's pipeline, the driver sits on stage 0)::

    stage 0   embed+layers(mb0) ─send─▶   embed+layers(mb1) ─send─▶   … recv ─▶ norm, logits, sample
    stage 1                  recv ─▶ layers(mb0) ─send─▶ recv ─▶ layers(mb1) ─send─▶ …
    last stage sends (x, residual) back to stage 0 (same tensor-parallel rank t)

The running batch (already ordered decodes first) is cut into at most
``num_stages`` contiguous micro-batches of about equal request counts, so while
stage 1 runs micro-batch 0 stage 0 runs micro-batch 1. Activations go point to
point (``isend``/``irecv``: one ``(2, tokens, hidden)`` tensor, ``x`` and the
residual, per micro-batch), tagged by micro-batch. Each stage's attention layers
hold only their own layers' KV cache. Every rank derives the same micro-batches
from the same ``SchedulerOutput``, so no shapes travel.
"""

from __future__ import annotations

import torch

from executor.engine.scheduler_output import ScheduledRequest
from executor.models.parallel import COMM
from executor.worker.model_runner import ModelRunner


def split_microbatches(scheduled: list[ScheduledRequest], num_stages: int) -> list[list[ScheduledRequest]]:
    """``scheduled`` cut into ``min(num_stages, len(scheduled))`` contiguous runs of
    about equal length (the first ones one longer)."""
    n = min(num_stages, len(scheduled))
    base, extra = divmod(len(scheduled), n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append(scheduled[start:start + size])
        start += size
    return out


class PipelineModelRunner(ModelRunner):
    """A ``ModelRunner`` of one pipeline stage.

    Args:
        loaded, block_size, seed, device, driver: as ``ModelRunner``.
        rank: this process's global rank.
        tensor_parallel_size: ranks per stage ``T``.
        num_stages: pipeline stages ``P``.
    """

    def __init__(self, loaded, block_size: int, seed: int, device, driver: bool, rank: int,
                 tensor_parallel_size: int, num_stages: int):
        super().__init__(loaded, block_size, seed, device, driver)
        self.stage, t = divmod(rank, tensor_parallel_size)
        self.num_stages = num_stages
        self.next_rank = ((self.stage + 1) % num_stages) * tensor_parallel_size + t
        self.prev_rank = ((self.stage - 1) % num_stages) * tensor_parallel_size + t
        self.hidden_size = int(loaded.hf_config.hidden_size)
        self.dtype = loaded.dtype

    def _forward(self, scheduled, input_ids, positions, md) -> torch.Tensor | None:
        batches = split_microbatches(scheduled, self.num_stages)
        self.last_micro_batches = batches
        inputs = [self._prepare_inputs(mb) for mb in batches]
        sends = []
        for i, (ids, pos, mb_md) in enumerate(inputs):
            self.attention_backend.plan(mb_md)
            if self.stage == 0:
                x, residual = self.model.run_layers(self.model.embed(ids), None, pos, mb_md)
            else:
                x, residual = self._recv(i, mb_md.num_tokens)
                x, residual = self.model.run_layers(x, residual, pos, mb_md)
            sends.append(self._send(i, x, residual))
        if self.stage != 0:
            for work, _ in sends:
                work.wait()
            return None
        hidden = [self.model.final_norm(*self._recv(i, mb_md.num_tokens)) for i, (_, _, mb_md) in enumerate(inputs)]
        for work, _ in sends:
            work.wait()
        return torch.cat(hidden)

    def _send(self, tag: int, x: torch.Tensor, residual: torch.Tensor):
        packed = torch.stack([x, residual])  # (2, tokens, hidden): one message per micro-batch
        COMM.p2p_bytes += packed.numel() * packed.element_size()
        return torch.distributed.isend(packed, self.next_rank, tag=tag), packed  # the buffer lives until sent

    def _recv(self, tag: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        torch.distributed.recv(packed, self.prev_rank, tag=tag)
        return packed[0], packed[1]
