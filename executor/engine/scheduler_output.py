"""What ``BatchScheduler.schedule()`` hands to the worker group's
``execute_model()``, and what comes back to ``BatchScheduler.update_from_output()``.

Plain, picklable data only (ints, strings, lists, bytes, frozen parameter
dataclasses; no ``Request`` object, no tensor): the worker never sees scheduler
state, so it cannot change it, and a step can be sent to a worker in another
process as it is (``tests/executor/test_worker.py`` pickles a real step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from executor.engine.outputs import TokenLogprob
from meshserve.block_hash import BlockHash
from meshserve.sampling import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the ``num_scheduled_tokens`` tokens to run, at positions
            ``num_computed_tokens ..`` of the sequence.
        num_computed_tokens: tokens already in the KV cache (positions start here).
        block_ids: all the request's blocks in logical order; they hold
            ``num_computed_tokens + num_scheduled_tokens`` tokens.
        sampling_params: the request's parameters.
        sample: after this step every known token is computed, so the runner
            samples the next one (False for a prefill chunk that is not the last).
        all_token_ids: the request's prompt + output tokens: in process, a read-only
            view of the scheduler's list (not a copy), valid until
            ``update_from_output``; a copy once pickled. The sampler reads it for
            penalties and ``min_tokens``.
        num_prompt_tokens: the prompt's length; ``all_token_ids[num_prompt_tokens:]``
            are the outputs so far.
        grammar_bitmask: with ``sample`` and a structured output, the tokens its grammar
            allows next: ``ceil(vocab_size / 32)`` little-endian int32 words, bit ``j`` of
            word ``w`` for token ``32 * w + j`` (xgrammar's layout); None: no constraint.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    sample: bool
    all_token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    grammar_bitmask: bytes | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (0 during the prompt's prefill)."""
        return max(0, len(self.all_token_ids) - self.num_prompt_tokens)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BlockSave:
    """A full block this step computes, to be copied out after the forward pass and
    published to the kvstore (``executor.engine.kv_connector``).

    Attributes:
        block_id: the physical block.
        block_hash: its chain hash (``meshserve.block_hash``).
        request_id: the request computing it (its trace parents the publish).
    """

    block_id: int
    block_hash: BlockHash
    request_id: str


@dataclass
class SchedulerOutput:
    """One step's batch.

    Attributes:
        scheduled: the requests of this step, decodes first, then prefill chunks.
        num_scheduled_tokens: total tokens (<= ``max_num_batched_tokens``).
        preempted_request_ids: requests preempted while scheduling this step.
        finished_request_ids: requests that finished or were aborted since the
            previous ``schedule()``; the runner drops its state for them.
        kv_loads: ``(block_id, payload)`` of blocks fetched from the kvstore that the
            worker copies into the paged cache before the forward pass (payload:
            the raw bytes of one block, ``executor.worker.kv_connector``).
        kv_saves: blocks the worker copies out after the forward pass, for publishing.
    """

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    kv_loads: list[tuple[int, bytes | bytearray]] = field(default_factory=list)
    kv_saves: list[BlockSave] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """The sampled tokens of one step.

    Attributes:
        sampled_token_ids: request id → the token sampled for it, for every
            scheduled request whose ``sample`` was True.
        logprobs: request id → the sampled token's logprobs, for requests with
            ``SamplingParams.logprobs`` that sampled.
        prompt_logprobs: request id → its whole prompt's logprobs (positions
            1 .. num_prompt - 1), in the step that samples its first token.
        kv_saved: the payloads of ``SchedulerOutput.kv_saves``, in the same order.
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    kv_saved: list[bytes] = field(default_factory=list)
