"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step:

1. order the scheduled requests decodes first (query length 1, longest sequence
   first, so attention can batch decodes of similar length), prefill chunks after;
2. build the flattened, unpadded inputs: ``input_ids`` and ``positions``
   ``(num_tokens,)`` int64 and the ``AttentionMetadata`` (``slot_mapping``,
   ``block_table``, ``query_start_loc``, ``seq_lens``);
3. run the model under ``torch.inference_mode`` (a decode-only step through its
   ``torch.compile`` graph when the worker set ``compiled_decode``: ``--compile``);
4. compute logits only at the last scheduled token of each request whose
   prefill is complete (``ScheduledRequest.sample``) and sample them (with the
   sampled tokens' logprobs when asked);
5. for requests with ``prompt_logprobs``, compute logits at their prompt
   positions too, a bounded slice at a time (``executor.worker.logprobs``).

A pure-decode step that fits a CUDA-graph bucket skips 2-3: ``graphs``
(``executor.worker.cuda_graphs.CUDAGraphRunner``) pads it to its bucket and replays
that bucket's graph, and the steps continue from 4 with the real rows' hidden states.

The runner owns the per-request seeded generators and the partial prompt
logprobs, and nothing of the scheduler's state; the worker owns the KV cache
tensors (bound to the attention layers) and copies fetched blocks in before.
"""

from __future__ import annotations

import numpy as np
import torch

from executor.attention import build_attention_metadata
from executor.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from executor.model_loader import LoadedModel
from executor.worker.compiled_decode import CompiledDecode
from executor.worker.cuda_graphs import CUDAGraphRunner
from executor.worker.logprobs import PromptLogprobs
from executor.worker.sampler import Sampler, SamplingBatch


class ModelRunner:
    """Runs the model over the paged KV cache its attention layers are bound to.

    Args:
        loaded: the model and its limits.
        block_size: tokens per block.
        seed: seed of the sampler's shared generator.
        device: device of the model and cache.
        driver: this runner samples (rank 0 of a parallel group, or the only rank).
            The others run the same forward passes and logits (their collectives
            need every rank) and return no tokens.
        graphs: runs pure-decode steps padded to a batch-size bucket (CUDA graphs);
            None: every step runs eagerly.
    """

    def __init__(self, loaded: LoadedModel, block_size: int, seed: int = 0, device: torch.device | str = "cpu",
                 driver: bool = True, graphs: CUDAGraphRunner | None = None):
        self.driver = driver
        self.graphs = graphs
        self.model = loaded.model
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.device = torch.device(device)
        self.block_size = block_size
        self.attention_backend = self.model.attention_layers()[0].backend
        self.sampler = Sampler(seed, self.device)
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs = PromptLogprobs()
        self.last_micro_batches: list[list[ScheduledRequest]] = []  # what the last step ran, in order
        self.compiled_decode: CompiledDecode | None = None  # set by the worker with --compile

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over the step's batch.

        Returns:
            The token sampled for each scheduled request with ``sample`` set, its
            logprobs when asked, and complete prompt logprobs when asked.
        """
        self.release(scheduler_output.finished_request_ids)
        self.last_micro_batches = []
        scheduled = sorted(scheduler_output.scheduled, key=_batch_order)
        if not scheduled:
            return ModelRunnerOutput({})
        padded = self.graphs.pad(scheduled) if self.graphs is not None else None
        if padded is None:
            input_ids, positions, md = self._prepare_inputs(scheduled)
            query_start_loc = md.query_start_loc_cpu
        else:
            query_start_loc = list(range(len(scheduled) + 1))
        sampling = [(i, s) for i, s in enumerate(scheduled) if s.sample]
        with torch.inference_mode():
            if padded is None:
                hidden = self._forward(scheduled, input_ids, positions, md)
            else:
                self.last_micro_batches = [scheduled]
                hidden = self.graphs.run(padded)
            if hidden is None:  # a pipeline stage other than the first: its part is done
                return ModelRunnerOutput({})
            prompt_logprobs = self.prompt_logprobs.collect(scheduled, query_start_loc, hidden,
                                                           self.model.compute_logits)
            if not sampling:
                return ModelRunnerOutput({})
            last = torch.tensor([query_start_loc[i + 1] - 1 for i, _ in sampling], device=self.device)
            logits = self.model.compute_logits(hidden[last])
            if not self.driver:
                return ModelRunnerOutput({})
            batch = SamplingBatch.build([s.sampling_params for _, s in sampling],
                                        [self._generator(s) for _, s in sampling], self.vocab_size, self.device,
                                        token_ids=[s.all_token_ids for _, s in sampling],
                                        num_prompt_tokens=[s.num_prompt_tokens for _, s in sampling],
                                        eos_token_ids=self.eos_token_ids,
                                        grammar_bitmasks=[s.grammar_bitmask for _, s in sampling])
            sampled = self.sampler(logits, batch)
        ids = [s.request_id for _, s in sampling]
        logprobs = {} if sampled.logprobs is None else {
            rid: lp for rid, lp in zip(ids, sampled.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, sampled.token_ids.tolist())), logprobs, prompt_logprobs)

    def _forward(self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                 md) -> torch.Tensor | None:
        """The forward pass of the whole batch: ``(num_tokens, hidden_size)`` final-normed
        hidden states (``executor.worker.pipeline.PipelineModelRunner`` runs it as
        micro-batches over stages, and returns None on stages other than the first)."""
        self.last_micro_batches = [scheduled]
        if self.compiled_decode is not None and self.compiled_decode.handles(md):
            return self.compiled_decode.forward(input_ids, positions, md)
        self.attention_backend.plan(md)
        return self.model(input_ids, positions, md)

    def release(self, request_ids: set[str]) -> None:
        """Drops per-request state (seeded generators, prompt logprobs) of finished requests."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        self.prompt_logprobs.release(request_ids)

    def _generator(self, scheduled: ScheduledRequest) -> torch.Generator | None:
        """The request's own generator when it has a seed (made at its first sample)."""
        seed = scheduled.sampling_params.seed
        if seed is None or scheduled.sampling_params.greedy:
            return None
        generator = self.generators.get(scheduled.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[scheduled.request_id] = generator
        return generator

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]):
        """``input_ids`` ``(num_tokens,)`` int64, ``positions`` ``(num_tokens,)`` int64 and
        the ``AttentionMetadata`` of requests already ordered decodes first."""
        query_lens = [s.num_scheduled_tokens for s in scheduled]
        computed = [s.num_computed_tokens for s in scheduled]
        md = build_attention_metadata(query_lens, computed, [s.block_ids for s in scheduled], self.block_size,
                                      self.device)
        token_ids = [t for s in scheduled for t in s.token_ids]
        q_lens = np.asarray(query_lens)
        starts = np.repeat(np.asarray(computed) - np.asarray(md.query_start_loc_cpu[:-1]), q_lens)
        positions = np.arange(md.num_tokens) + starts
        return (torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                torch.from_numpy(positions).to(self.device), md)


def _batch_order(scheduled: ScheduledRequest) -> tuple[bool, int]:
    """Sort key: decodes first, longest first; prefill chunks after, in scheduling order."""
    decode = scheduled.num_scheduled_tokens == 1
    return (not decode, -scheduled.num_computed_tokens if decode else 0)
