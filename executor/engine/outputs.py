"""What the engine hands back: per-request outputs of a step, and engine counters
(its own and its kvstore connector's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities at one position, from the model's raw distribution
    (``log_softmax`` of the float32 logits before masks, logit bias, penalties and temperature).

    Attributes:
        token_id: the token at this position (sampled, or the prompt's own).
        logprob: its natural-log probability (<= 0).
        top_token_ids: the k most likely token ids, highest first.
        top_logprobs: their logprobs, same order (non-increasing, <= 0).
        rank: ``token_id``'s rank in the vocabulary: how many tokens have a logprob
            at least its own (1: the most likely; vLLM's ``Logprob.rank``); 0: not known.
    """

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0


@dataclass
class RequestOutput:
    """One request's result of one engine step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens sampled this step (empty only when finishing without one).
        finished: the request is done; no more outputs follow.
        finish_reason: ``"stop"`` (EOS or a stop token id), ``"length"`` (max_tokens or
            max_model_len) or ``"abort"``; None while unfinished.
        num_cached_tokens: prompt tokens whose KV was reused from the prefix cache.
        logprobs: with ``SamplingParams.logprobs``, one entry per new token; else None.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the request's
            first output only: one entry per prompt position 1 .. num_prompt - 1.
        num_kvstore_tokens: of ``num_cached_tokens``, tokens loaded from the kvstore.
        preempted_at_ns: wall-clock times (``time.time_ns()``, ns since the epoch) of
            the request's preemptions since its previous output (the executor's span
            events); usually empty.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    num_kvstore_tokens: int = 0
    preempted_at_ns: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVConnectorStats:
    """Counters of a connector (a snapshot).

    Attributes:
        fetches: fetches finished (any outcome).
        fetched_blocks: blocks received and verified.
        bytes_in: payload bytes received (verified or not).
        fetch_failures: fetches that ended on an error (unreachable store, failed
            call), a corrupt block, or their deadline (given up by the engine).
        corrupt_blocks: blocks whose checksum did not match.
        fetch_seconds: total seconds from start to finish of the finished fetches.
        published_blocks: blocks the store acknowledged (stored or already there).
        bytes_out: payload bytes sent by publishes.
        publish_dropped_blocks: blocks not published because the queue was full,
            or because the Put failed.
    """

    fetches: int = 0
    fetched_blocks: int = 0
    bytes_in: int = 0
    fetch_failures: int = 0
    corrupt_blocks: int = 0
    fetch_seconds: float = 0.0
    published_blocks: int = 0
    bytes_out: int = 0
    publish_dropped_blocks: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters.

    Attributes:
        num_blocks: KV blocks in the cache.
        num_free_blocks: blocks not held by any request.
        num_running: requests in the running batch.
        num_waiting: requests waiting (new or preempted).
        num_steps: engine steps that ran a batch.
        num_joined_running_batch: requests first scheduled in a step whose batch
            already held requests from the previous step (continuous batching).
        num_finished: requests finished for any reason, aborts included.
        num_aborted: requests aborted.
        num_preemptions: preemptions (recompute) so far.
        block_size: tokens per block.
        max_model_len: longest sequence accepted (tokens).
        prefix_cache_queried_tokens: prompt tokens looked up in the prefix cache.
        prefix_cache_hit_tokens: of those, tokens reused from it.
        kv_cache_utilization: tokens stored / slots of the blocks held by requests,
            in [0, 1]; 1.0 when no block is held.
        num_cached_free_blocks: free blocks still holding reusable prefix KV.
        num_prompt_tokens: prompt tokens computed (cache hits excluded, recomputes included).
        num_generation_tokens: tokens sampled.
        num_blocks_by_request: ``(request_id, blocks held)`` of every request
            holding blocks, sorted by id (the scheduler charges them to the
            tenants' KV quotas per lease).
        kvstore_hit_tokens: prompt tokens loaded from the kvstore instead of computed.
        kvstore_queried_tokens: prompt tokens asked of the kvstore (full blocks
            missing from the local cache at admission).
        kvstore: the kvstore connector's counters (None without a connector).
        forward_seconds: wall seconds spent in the model's forward passes (with
            sampling), all steps together.
        num_forward_tokens: tokens run through those forward passes.
    """

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_joined_running_batch: int
    num_finished: int
    num_aborted: int
    num_preemptions: int
    block_size: int
    max_model_len: int
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    kv_cache_utilization: float = 1.0
    num_cached_free_blocks: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_blocks_by_request: tuple[tuple[str, int], ...] = ()
    kvstore_hit_tokens: int = 0
    kvstore_queried_tokens: int = 0
    kvstore: KVConnectorStats | None = None
    forward_seconds: float = 0.0
    num_forward_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query)."""
        return (self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens
                if self.prefix_cache_queried_tokens else 0.0)
