"""What ``BatchScheduler.schedule()`` hands to ``ModelRunner.execute_model()``, and
what comes back to ``BatchScheduler.update_from_output()``.

Plain data only: the runner never sees a ``Request`` object, so it cannot change
scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from executor.engine.outputs import TokenLogprob
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
        all_token_ids: the request's prompt + output tokens: a read-only view of
            the scheduler's list (not a copy), valid until ``update_from_output``;
            the sampler reads it for penalties and ``min_tokens``.
        num_prompt_tokens: the prompt's length; ``all_token_ids[num_prompt_tokens:]``
            are the outputs so far.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    sample: bool
    all_token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (0 during the prompt's prefill)."""
        return max(0, len(self.all_token_ids) - self.num_prompt_tokens)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


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
            runner copies into the paged cache before the forward pass (payload:
            the raw bytes of one block, ``ExternalKV``).
    """

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    kv_loads: list[tuple[int, object]] = field(default_factory=list)

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
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
