"""What the gateway core yields while it runs a request: plain dataclasses, no protobuf.

``GatewayCore.run`` / ``generate`` (``gateway.generation``) yield, in order::

    Queued*       while the scheduler's admission queue holds the request
    (Delta | ChoiceResult)*   deltas of the n choices interleaved; each choice ends with
                  its own ChoiceResult, and the stream ends after the last one

Errors are not events: they are raised as ``meshserve.errors.MeshError`` subclasses
(an adapter maps them to its status codes). The value types here (``TokenLogprob``,
``Usage``, ``Timings``, ``FinishReason``) are also what the executor client returns
and what the result cache keeps; all are immutable, so a cached value can be
replayed any number of times.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a choice ended (None where it has not)."""

    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens (or max_model_len) reached
    ABORT = "abort"  # aborted in the executor (cancelled, or the executor went away)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One candidate token at a position: its id and natural-log probability (<= 0)."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probabilities at one position (the model's raw distribution).

    Attributes:
        token_id: the token at this position (the sampled one, or the prompt's own).
        logprob: its natural-log probability (<= 0).
        top: the k most likely tokens, highest first (k = the request's logprobs).
        rank: ``token_id``'s rank in the vocabulary (how many tokens have a logprob at
            least its own; 1: the most likely, vLLM's); 0: not known.
    """

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one choice (tokens)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    kvstore_tokens: int = 0  # of cached_tokens, those fetched from the kvstore


@dataclass(frozen=True, slots=True)
class Timings:
    """Latencies of one choice, in seconds from the gateway receiving the request."""

    queue_s: float  # to the scheduler's assignment
    ttft_s: float  # to the first token (0 when there was none)
    tpot_s: float  # mean gap between tokens after the first (0 with < 2 tokens)
    e2e_s: float  # to the choice's result


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits in the scheduler's admission queue.

    Attributes:
        position: 0-based position in the queue.
        estimated_wait_s: estimated wait before assignment (seconds).
    """

    position: int
    estimated_wait_s: float


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one choice.

    Attributes:
        index: the choice, in [0, n).
        text: text that became final with these tokens (may be empty while a
            multi-byte character or a possible stop string is incomplete). A
            request with ``include_stop_str_in_output`` gets the stop string that
            ended a choice as one more delta of no tokens, right before its result.
        token_ids: the newly generated token ids.
        logprobs: with ``SamplingParams.logprobs``: one entry per token id.
        last: the choice ended with these tokens: its result comes next (after the
            kept stop string's delta, itself ``last``, with ``include_stop_str_in_output``).
            An adapter may send them together (vLLM's streams carry the finish reason on
            the last token's chunk).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    last: bool = False


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """The last event of one choice.

    Attributes:
        request_id: the request's id.
        index: the choice, in [0, n).
        finish_reason: why it ended.
        usage / timings: this choice's own.
        prompt_token_ids: the prompt as the model saw it.
        executor_id: the executor that ran it ("" when the result cache answered).
        stop_reason: the stop string that ended it ("" when none did).
        stop_token_id: the token, one of the request's ``stop_token_ids``, that ended it
            (vLLM's ``stop_reason`` when no stop string did); None when none did: a stop
            string, the length, an abort, or the model's EOS (which comes first, as in
            vLLM's ``check_stop``, unless ``ignore_eos``).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, choice 0 only: one
            entry per prompt position after the first.
        cached: the result cache answered (no executor ran; usage is the earlier
            request's, timings this one's).
    """

    request_id: str
    index: int
    finish_reason: FinishReason | None
    usage: Usage
    timings: Timings
    prompt_token_ids: tuple[int, ...]
    executor_id: str
    stop_reason: str = ""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    cached: bool = False
    stop_token_id: int | None = None


Event = Queued | Delta | ChoiceResult
