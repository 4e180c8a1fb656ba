"""A request inside the engine: its tokens, progress and status.

The batch scheduler owns every mutable field here (status, ``num_computed_tokens``,
outputs); the KV cache manager and the model runner only read.

Token accounting (the only "phase" there is)::

    all_token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]        num_tokens = 7
                      ^^^^^^^^^^^^^^^^^^^^^            num_computed_tokens = 6 (K/V in cache)
                                             ^^        next step computes o1 and samples o2

A new request has ``num_computed_tokens == 0``; a decode has ``num_tokens -
num_computed_tokens == 1``; a preempted request is reset to 0 and recomputes its
prompt *and* its outputs, so preemption needs no special mode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from meshserve.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Request lifecycle. Ordering rule: every status above ``PREEMPTED`` is finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # its prefix blocks are being fetched from the kvstore
    RUNNING = 2
    PREEMPTED = 3             # waiting again, will recompute
    FINISHED_STOPPED = 4      # EOS or a stop token id
    FINISHED_LENGTH_CAPPED = 5  # max_tokens or max_model_len
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class CheckedRequest:
    """A prompt and its sampling parameters as ``LLMEngine.check_request`` accepted them
    against that engine's limits: made there, once where a request enters the executor,
    and taken by ``LLMEngine.add_checked`` without checking again.

    Attributes:
        prompt_token_ids: the prompt (non-empty, ids in the vocabulary, fits the cache).
        sampling_params: validated and normalised (``meshserve.sampling.validate``).
        cache_salt: salts the request's chain hashes (``meshserve.block_hash.salted_root``):
            requests with different salts never share prefix blocks; "" shares with all.
        grammar: the ``xgrammar.CompiledGrammar`` of ``sampling_params.structured_output``
            (``executor.engine.structured_output``), shared by the request's choices; None
            without one.
    """

    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    cache_salt: str = ""
    grammar: object = None

    def for_choice(self, index: int) -> "CheckedRequest":
        """Choice ``index`` of an ``n`` > 1 request (``SamplingParams.for_choice``: seed +
        index, prompt logprobs on choice 0 only; both keep the params valid)."""
        return CheckedRequest(self.prompt_token_ids, self.sampling_params.for_choice(index), self.cache_salt,
                              self.grammar)


@dataclass(eq=False)
class Request:
    """One generation request.

    Attributes:
        request_id: unique id.
        prompt_token_ids: prompt tokens (non-empty).
        sampling_params: validated sampling parameters.
        priority: higher runs first and is preempted last.
        arrival: engine-wide arrival counter (FCFS tie-break; larger is later).
        max_len: ``num_tokens`` at which the request stops with "length":
            ``min(max_model_len, num_blocks * block_size)`` (``max_tokens`` is
            checked separately).
        output_token_ids: sampled tokens so far.
        num_computed_tokens: tokens whose K/V are in the cache.
        status: see ``RequestStatus``.
        num_preemptions: times this request was preempted.
        preempted_at_ns: ``time.time_ns()`` of each preemption not yet reported in an
            output (``RequestOutput.preempted_at_ns``; the servicer's span events).
        num_cached_tokens: tokens reused from the prefix cache when first scheduled.
        arrival_time: ``time.monotonic()`` seconds when the batch scheduler got it.
        num_kvstore_tokens: of ``num_cached_tokens``, tokens loaded from the kvstore.
        trace_context: the OpenTelemetry context of the request's span (opaque here),
            the parent of kvstore fetch and publish spans.
        cache_salt: salts its chain hashes (``CheckedRequest.cache_salt``).
        num_prefill_deferrals: steps its prefill sat out for shorter ones
            (``BatchSchedulerConfig.short_prefill_tokens``) or, waiting, was passed by a
            later arrival of no higher priority (``prefill_order`` "shortest"; whatever
            kept it out, a prefix being computed by another request included);
            ``executor.engine.prefill_order``.
        grammar: its structured output's matcher (``executor.engine.structured_output.GrammarState``),
            or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    arrival: int
    max_len: int
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    preempted_at_ns: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    num_kvstore_tokens: int = 0
    trace_context: object = None
    cache_salt: str = ""
    num_prefill_deferrals: int = 0
    grammar: object = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then earlier arrival.
        The preemption victim is the running request with the largest key."""
        return (-self.priority, self.arrival)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
